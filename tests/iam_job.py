"""A raytrain job on a 2-node local cluster whose driver holds the head role and whose worker node holds the worker
role (run by tests/test_iam.py).

Like cluster nodes: the driver's credentials come from its environment (the head's instance profile), the worker
node's from the environment its raylet was started with (its instance profile), which every task and Ray Train
worker on it inherits. Argv: corpus directory, bucket, result file. The worker role's variables arrive as JSON in IAM_WORKER_ENV.
Every command runs through `raytrain.cli.main`, as `raytrain ...` would; the result file says what each returned.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(corpus: str, bucket: str, result_file: str) -> None:
    import ray

    from raytrain.cli import main as cli
    from tests.helpers import tiny_overrides

    seconds: dict = {}

    def raytrain(argv: list[str]) -> int:
        t0 = time.monotonic()
        rc = cli(argv)
        seconds[" ".join(argv[:2])] = round(time.monotonic() - t0, 1)
        return rc

    worker_env = json.loads(os.environ["IAM_WORKER_ENV"])
    # A short temp dir of its own (Unix socket paths are limited to ~107 bytes), searched for credentials below.
    temp_dir = tempfile.mkdtemp(prefix="rtiam", dir="/tmp")
    cluster = _two_nodes(temp_dir, worker_env)
    ray.init(address=cluster.address, log_to_driver=False)
    where = ray.remote(lambda: (os.environ["AWS_ACCESS_KEY_ID"], ray.get_runtime_context().get_node_id()))
    worker_key, worker_node = ray.get(where.remote())
    out: dict = {"temp_dir": temp_dir, "driver_key": os.environ["AWS_ACCESS_KEY_ID"], "worker_key": worker_key,
                 "nodes": len([n for n in ray.nodes() if n["Alive"]]),
                 "task_on_head": worker_node == cluster.head_node.node_id}
    data, runs = f"s3://{bucket}/data/synthetic", f"s3://{bucket}/runs"
    run = f"{runs}/iam"
    # engine=ray: the shards are written by Ray workers, with the worker role (cluster/iam/README.md).
    out["prepare"] = raytrain(["prepare", f"inputs=[{corpus}]", f"out={data}", "vocab_size=300", "seq_len=32",
                               "shard_rows=64", "near_dup_threshold=1.0", "val_fraction=0.1", "engine=ray"])
    train = ["train", "--config", "tiny", *tiny_overrides(data, runs, "iam", "scaling.num_workers=1",
                                                           "checkpoint.every_n_steps=2", "checkpoint.upload=sync",
                                                           "checkpoint.keep_last=5")]
    out["train"] = raytrain([*train, "run.max_steps=4"])
    out["resume"] = raytrain([*train, "run.max_steps=6"])  # resumes from checkpoint 4
    out["eval"] = raytrain(["eval", "--checkpoint", f"{run}/checkpoint_00000006", "--workers", "1", "--json"])
    out["export"] = raytrain(["export", "--checkpoint", f"{run}/checkpoint_00000006", "--out", f"{run}/exports/manual"])
    out["ckpt list"] = raytrain(["ckpt", "list", run])
    out["ckpt verify"] = raytrain(["ckpt", "verify", run])
    out["ckpt tag"] = raytrain(["ckpt", "tag", run, "v1", "--step", "2"])
    out["ckpt prune"] = raytrain(["ckpt", "prune", run, "--keep-last", "1", "--yes"])
    out["serve"] = serve_paths(f"{run}@v1")
    out["seconds"] = seconds
    ray.shutdown()
    cluster.shutdown()
    with open(result_file, "w") as f:
        json.dump(out, f)


def _two_nodes(temp_dir: str, worker_env: dict):
    """A 2-node local cluster like a real one: a head with no CPUs for tasks (the driver, as this process, holds the
    head's role) and a worker node whose raylet - so every task and Ray Train worker on it - holds the worker's
    role in its environment, as an instance profile would give it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    cluster.add_node(num_cpus=0, temp_dir=temp_dir, include_dashboard=False)
    head_env = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)
    try:
        cluster.add_node(num_cpus=4)
    finally:
        for k, v in head_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    cluster.wait_for_nodes()
    return cluster


def serve_paths(model: str) -> str:
    """`raytrain serve` without Serve's proxy and controller (they touch no storage, and two proxies of one machine's
    nodes would want one port): the driver resolves RUN@TAG (exporting the tagged checkpoint next to the run), then
    the Serve replica's own class, built in a Ray task on the worker node, loads the model from there and answers
    a request. "<version> <params> <completion tokens>"."""
    import ray

    from raytrain.serving.source import resolve

    served = resolve(model, log=lambda *_: None)

    @ray.remote
    def replica(uri: str, version: str) -> str:
        from raytrain.serving.app import ModelServer

        server = ModelServer.func_or_class(uri, version)
        # The batch's body: @serve.batch itself wants a Serve replica context, which a plain task has not.
        out = server._run([{"text": "one two three", "max_new_tokens": 3}])[0]
        assert out["status"] == 200 and out["version"] == version, out
        return f"{server.info()['params']} {out['completion_tokens']}"

    return f"{served.version} {ray.get(replica.remote(served.uri, served.version))}"


if __name__ == "__main__":
    main(*sys.argv[1:4])
