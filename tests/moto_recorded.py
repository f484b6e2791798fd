"""moto's S3 server (as `moto_server` runs it) that also records each request's arrival: `time method path` lines.

    python tests/moto_recorded.py HOST PORT RECORD_FILE

Tests count the requests in a window of time (none between a fault and the first resumed step, when host
memory serves the restore): counted at the server, whoever sent them.
"""

import sys
import threading
import time

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def main() -> None:
    host, port, record = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    app = DomainDispatcherApplication(create_backend_app)
    out = open(record, "a", buffering=1)  # line-buffered: a reader sees every request that has arrived
    lock = threading.Lock()

    def recorded(environ, start_response):
        with lock:
            out.write(f"{time.time():.3f} {environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')}\n")
        return app(environ, start_response)

    run_simple(host, port, recorded, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
