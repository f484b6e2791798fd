"""`raytrain plan`: the capacity plan (raytrain.capacity) for a model on a GPU type, as a table or JSON."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain.capacity import Plan


def add_parser(subparsers):
    pl = subparsers.add_parser("plan", help="capacity plan: memory per GPU for each ZeRO stage, a recommended setup, "
                               "time and cost for a token budget (docs/PLANNING.md)")
    pl.add_argument("--model", required=True, help="a size (124m, 350m, 1b, 7b, 10b, 13b, 70b, 8x7b, ...), a recipe "
                    "name or a config YAML")
    pl.add_argument("--gpu", required=True, help="GPU type: a100-80gb, a100-40gb, h100, h200, l4, ...")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs in the run (data-parallel ranks)")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--seq-len", type=int, default=None, help="context length (default: the model's)")
    pl.add_argument("--tokens", default=None, help="token budget for time and cost, e.g. 300B, 1.4T")
    pl.add_argument("--micro-batch", type=int, default=None, help="fix the micro-batch instead of the largest that fits")
    pl.add_argument("--global-batch-tokens", type=int, default=2**20, help="target tokens per optimizer step")
    pl.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    pl.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the family's usual one)")
    pl.add_argument("--price-on-demand", type=float, default=None, help="USD per GPU-hour, overrides the table")
    pl.add_argument("--price-spot", type=float, default=None, help="USD per GPU-hour, overrides the table")
    pl.add_argument("--host-memory-gib", type=float, default=1024.0, help="host RAM per node (offload and model "
                    "construction live there)")
    pl.add_argument("--node-gbps", type=float, default=10.0, help="a node's bandwidth from checkpoint storage in "
                    "Gbit/s, for the restore time (default 10)")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--write", metavar="RECIPE.yaml", default=None,
                    help="also write the recommended setup as a recipe for `raytrain train --config` (storage and data "
                         "marked EDIT)")
    return pl


def run(args) -> int:
    import contextlib

    from raytrain.capacity import make_plan, parse_tokens

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log lines must not mix into --json
        plan = make_plan(args.model, args.gpu, args.gpus, seq_len=args.seq_len,
                         tokens=parse_tokens(args.tokens) if args.tokens else None, micro_batch=args.micro_batch,
                         mfu=args.mfu, gpus_per_node=args.gpus_per_node, global_batch_tokens=args.global_batch_tokens,
                         vocab=args.vocab, price_on_demand=args.price_on_demand, price_spot=args.price_spot,
                         host_memory_gib=args.host_memory_gib, node_gbps=args.node_gbps)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    if args.write:
        from raytrain.capacity import recipe

        text = recipe(plan, _command(args))
        with open(args.write, "w") as f:
            f.write(text)
        print(f"wrote {args.write}: raytrain config --config {args.write} shows it resolved", file=sys.stderr)
    return 0


def _command(args) -> str:
    """The plan's own command line (the flags that shape the recipe), for the written recipe's header."""
    flags = [f"--model {args.model}", f"--gpu {args.gpu}", f"--gpus {args.gpus}",
             f"--gpus-per-node {args.gpus_per_node}"]
    for name in ("seq_len", "micro_batch", "vocab"):
        if getattr(args, name) is not None:
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    if args.global_batch_tokens != 2**20:
        flags.append(f"--global-batch-tokens {args.global_batch_tokens}")
    if args.host_memory_gib != 1024.0:
        flags.append(f"--host-memory-gib {args.host_memory_gib:g}")
    return "raytrain plan " + " ".join(flags)


def human(n: float) -> str:
    """1.24e8 -> 124.00M."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_plan(p: Plan) -> str:
    """The plan as a table of strategies, the recommended setup and its time and cost."""
    moe = f" ({human(p.active_params)} active per token)" if p.active_params != p.params else ""
    lines = [f"model {p.model}: {p.family}, {human(p.params)} parameters{moe}, seq_len {p.seq_len}",
             "  shape: " + " ".join(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                                    for k, v in p.shape.items()),
             f"hardware: {p.gpus} x {p.gpu} ({p.gpu_memory_gib:g} GiB, {p.usable_gib:.1f} GiB usable at "
             f"{p.assumptions['memory_headroom']:.0%}), {p.gpus_per_node} GPUs per node", "",
             f"{'strategy':28} {'states GiB':>10} {'act GiB/seq':>11} {'host GiB/node':>13} {'max mb':>6} "
             f"{'fewest GPUs':>11} {'restore GiB/node':>16} {'restore s':>9}"]
    for o in p.options:
        fewest = p.fewest_gpus.get(o.strategy)
        lines.append(f"{o.strategy:28} {o.model_states_gib:>10.1f} {o.activations_gib_per_sample:>11.2f} "
                     f"{o.host_gib_per_node:>13.1f} {(o.max_micro_batch or '-'):>6} {(fewest or '-'):>11} "
                     f"{o.restore_gib_per_node:>16.1f} {o.restore_s:>9.0f}")
    lines.append(f"checkpoint: {p.checkpoint_gib:,.1f} GiB; restore: each node downloads only its ranks' files, "
                 f"at {p.assumptions['node_gbps']:g} Gbit/s per node (--node-gbps)")
    if p.instances:
        lines.append("instance types in cluster/: " + "; ".join(
            f"{r['instance']} ({r['gpus_per_node']} x {r['gpu']}, {r['host_gib']:g} GiB): "
            + (f"fits with {r['strategy']}" if r["fits"] else "does not fit") for r in p.instances))
    lines.append("")
    r = p.recommended
    if r is None:
        fits = [n for n in p.fewest_gpus.values() if n]
        lines.append(f"nothing fits on {p.gpus} x {p.gpu}" + (f"; the fewest GPUs that fit: {min(fits)}" if fits else ""))
        if not any(o.host_fits for o in p.options):
            need = min(o.host_gib_per_node for o in p.options)
            lines.append(f"host memory: {need:,.0f} GiB per node at least, {p.assumptions['host_memory_gib_per_node']:,.0f} GiB "
                         f"assumed (--host-memory-gib); use fewer GPUs per node (--gpus-per-node) or bigger hosts")
        return "\n".join(lines)
    lines += [f"recommended: {r['strategy']}, micro_batch {r['micro_batch_size']} x accumulation "
              f"{r['gradient_accumulation_steps']} x {p.gpus} GPUs = {r['global_batch_sequences']} sequences "
              f"({human(r['global_batch_tokens'])} tokens) per step, {r['nodes']} node(s), "
              f"~{r['memory_gib_per_gpu']:.1f} GiB per GPU",
              f"throughput: ~{human(r['tokens_per_s'])} tokens/s at MFU {p.assumptions['mfu']:.0%} "
              f"(x{strategy_factor(p, r):.2f} for the strategy)",
              "raytrain overrides: " + " ".join(r["overrides"])]
    if "tokens" in r:
        lines.append(f"{human(r['tokens'])} tokens: {r['wall_clock_h']:.1f} h wall clock, {r['gpu_hours']:,.0f} GPU-hours, "
                     f"${r['cost_on_demand_usd']:,.0f} on-demand (${p.assumptions['price_on_demand_per_gpu_h']:.2f}/GPU-h), "
                     f"${r['cost_spot_usd']:,.0f} spot (${p.assumptions['price_spot_per_gpu_h']:.2f}/GPU-h)")
    return "\n".join(lines)


def strategy_factor(p: Plan, r: dict) -> float:
    """The recommended strategy's throughput factor."""
    return next(o.throughput_factor for o in p.options if o.strategy == r["strategy"])
