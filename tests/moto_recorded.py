"""moto's S3 server (as `moto_server` runs it) that also records each request's arrival: `time method path` lines,
and for each response with a body, once it is sent: `time SENT bytes path`.

    python tests/moto_recorded.py HOST PORT RECORD_FILE

Tests count the requests in a window of time (none between a fault and the first resumed step, when host
memory serves the restore), or the bytes served under a prefix: counted at the server, whoever sent them.
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
        path = environ.get("PATH_INFO", "")
        with lock:
            out.write(f"{time.time():.3f} {environ['REQUEST_METHOD']} {path}\n")
        sent, body = 0, app(environ, start_response)
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()
        if sent:
            with lock:
                out.write(f"{time.time():.3f} SENT {sent} {path}\n")

    run_simple(host, port, recorded, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
