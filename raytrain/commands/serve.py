"""`raytrain serve`: `serve run MODEL` (or `serve MODEL`) on Ray Serve, or `serve promote|rollback|split` on a server."""

from __future__ import annotations

from raytrain.errors import UserError

ACTIONS = ("run", "promote", "rollback", "split")  # (room for more: a model directory named like one needs `serve run`)


def add_parser(subparsers):
    sv = subparsers.add_parser("serve", help="`serve run MODEL` (or `serve MODEL`): a model over HTTP on Ray Serve "
                               "(POST /predict, OpenAI's /v1/completions and /v1/chat/completions); "
                               "`serve promote|rollback|split --url URL` moves traffic between versions",
                               usage="raytrain serve {run MODEL | MODEL | promote | rollback | split} [options]")
    sv.add_argument("action", metavar="ACTION", help=f"{' | '.join(ACTIONS)}; anything else is a MODEL to run "
                    "(`serve MODEL` = `serve run MODEL`)")
    sv.add_argument("model", nargs="?", default=None, metavar="MODEL", help="with run: an exported model directory (local or s3://), a "
                    "run directory (its newest complete checkpoint, exported on the fly) or RUN@TAG (a tagged version)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--version", default=None, help="version name in responses (default: the tag, the directory's "
                    "name or step-N)")
    sv.add_argument("--canary", default=None, help="a second model served beside the first (same forms as MODEL)")
    sv.add_argument("--canary-version", default=None, help="the canary's version name")
    sv.add_argument("--canary-fraction", type=float, default=None, help="share of requests the canary answers "
                    "(0..1); with split: the new share")
    sv.add_argument("--url", default=None, help="promote / rollback / split: the running server")
    sv.add_argument("--ssl-certfile", default=None, metavar="CERT", help="serve HTTPS with this PEM certificate "
                    "(with --ssl-keyfile; `scripts/tls_certs.sh DIR` makes a CA and a pair); TLS 1.3 with modern "
                    "clients, TLS 1.1 and older refused")
    sv.add_argument("--ssl-keyfile", default=None, metavar="KEY", help="the certificate's private key (PEM, "
                    "unencrypted, mode 0600)")
    sv.add_argument("--ca-bundle", default=None, metavar="CA", help="promote / rollback / split on an https:// "
                    "--url: verify the server with this CA certificate (default: the system's trust store)")
    sv.add_argument("--replicas", type=int, default=1, help="model replicas per version (autoscaling minimum)")
    sv.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas per version")
    sv.add_argument("--cpus-per-replica", type=float, default=1)
    sv.add_argument("--max-batch-size", type=int, default=8, help="Serve dynamic batching: requests per batch")
    sv.add_argument("--chat-template", choices=("default", "none"), default="default", help="for models without a "
                    "chat template: raytrain's default (docs/SERVING.md) or none (/v1/chat/completions answers 400)")
    sv.add_argument("--metrics-port", type=int, default=None, help="local Ray only: Prometheus metrics on this port")
    sv.add_argument("--ready-file", default=None, help="write {url, stable, canary} here once serving (for scripts)")
    sv.add_argument("--audit", default=None, metavar="URI", help="where the deployment's audit records go (deploy, "
                    "promote, rollback, split, one record per request with prompt and completion sha256 and lengths), "
                    "local or s3://; default: beside the served model, <model dir>.audit (for a run: "
                    "<run>/exports/<checkpoint>.audit); none: no records")
    sv.add_argument("--audit-text", action="store_true", help="also keep each request's prompt and completion text "
                    "in the audit records (default: digests and lengths only)")
    return sv


def run(args) -> int:
    from raytrain.serving.run import serve_forever, traffic

    if args.action == "run" and args.model is None:
        raise UserError("serve run needs a MODEL: an exported model directory, a run directory or RUN@TAG")
    if args.action != "run":
        if args.model is not None:
            raise UserError(f"serve {args.action} {args.model}: one of {', '.join(ACTIONS)} first, or a MODEL alone")
        if args.action not in ACTIONS:
            args.model = args.action  # `serve MODEL`
    if args.model is None:  # promote | rollback | split
        if not args.url:
            raise UserError(f"serve {args.action} needs --url of the running server, e.g. --url http://127.0.0.1:8000")
        state = traffic(args.url, args.action, args.canary_fraction, ca_bundle=args.ca_bundle)
        print(f"stable {state['stable']}" + (f", canary {state['canary']} at {state['canary_fraction']:.0%}"
                                             if state["canary"] else ", no canary"))
        return 0
    if args.ca_bundle:
        raise UserError("--ca-bundle is for serve promote|rollback|split --url https://...; serving HTTPS takes "
                        "--ssl-certfile and --ssl-keyfile")
    return serve_forever(args.model, port=args.port, host=args.host, version=args.version, canary=args.canary,
                         canary_version=args.canary_version, canary_fraction=args.canary_fraction or 0.0,
                         replicas=args.replicas, max_replicas=args.max_replicas, num_cpus=args.cpus_per_replica,
                         max_batch_size=args.max_batch_size, chat_template=args.chat_template,
                         metrics_port=args.metrics_port, ready_file=args.ready_file, audit=args.audit,
                         audit_text=args.audit_text, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
