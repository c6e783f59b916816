"""Is a MoE step bound by the host? Two checks on a held-out hunt's rows (benchmarks/refusal_hunt*.md), issue 42.

1. Per MoE block, forward and backward, as the kernel model prices it (xpar.estimate.compute.kernel_block): the
   kernels it counts, the GPU's busy seconds, the host's seconds to issue them at the profile's ``host_op_us``
   (and at ``--host-us``, a what-if), and the dispatcher's synchronisation (xpar.estimate.moe_dispatch). A block
   is host-bound where the host's seconds exceed the busy ones.
2. ``--pair A,B``: two rows of one layout that differ in tokens per step (a weak-scaling pair): the step split into
   a part fixed per step and a part per token, published and xpar's (:func:`split_fixed`). A host-bound step is
   mostly fixed (its operators do not grow with the tokens); a step whose per-token part is off is not.

    python benchmarks/moe_host_bound.py --hunt benchmarks/refusal_hunt3.md --rows 22-25 --pair 24,25 [--host-us 20]

The hunt's rows are held out: this prints, it fits nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hunt_score import build, published, refuse, row_set, runs_table, sidecar_for  # noqa: E402
from xpar.estimate.compute.kernel_block import block_times, shape_of  # noqa: E402
from xpar.estimate.compute.kernel_costs import training_device  # noqa: E402
from xpar.estimate.cost import assumptions_for, estimate  # noqa: E402
from xpar.estimate.moe_dispatch import sync_seconds  # noqa: E402


def split_fixed(tokens_a: float, seconds_a: float, tokens_b: float, seconds_b: float) -> tuple[float, float]:
    """(seconds fixed per step, seconds per token) of the line through two steps (tokens per GPU, seconds).

    Raises:
        ValueError: the two steps have the same tokens."""
    if tokens_a == tokens_b:
        raise ValueError(f"a pair needs two token counts, got {tokens_a} twice")
    per_token = (seconds_b - seconds_a) / (tokens_b - tokens_a)
    return seconds_a - per_token * tokens_a, per_token


def moe_block_host(spec, assume, host_us: float | None = None) -> dict[str, dict[str, float]]:
    """Per pass ('forward', 'backward') of one MoE block on one rank at ``spec``'s micro-batch: ``kernels``, ``busy``
    (s), ``host`` (kernels x ``host_us`` us, s; None: the profile's ``host_op_us``), ``sync`` (the dispatcher's
    synchronisation, forward only, s) and ``overhead`` (the kernel model's, s), keywords as
    xpar.estimate.compute.kernel_costs prices a block.

    Raises:
        ValueError: the model has no experts."""
    if not spec.model.n_experts:
        raise ValueError(f"{spec.model.name} has no experts")
    us = assume.host_op_us if host_us is None else host_us
    kw = dict(tp=spec.tp, ep=spec.layout.ep, dtype=spec.train.dtype, host_us_per_kernel=assume.host_op_us,
              sequence_parallel=spec.layout.sequence_parallel, flash=assume.flash_attention, dropout=assume.dropout,
              dispatcher=assume.ep_dispatcher, expert_call_us=assume.expert_gemm_call_us,
              kv_over_tp=spec.framework.kv_heads_over_tp, fp8_recipe=spec.train.fp8_recipe,
              window_kernel=assume.sliding_window_kernel, moe_scatter=assume.moe_scatter,
              expert_gemm_kernel=assume.expert_gemm_kernel)
    device, sh = training_device(spec.hardware, assume.attention_kernel), shape_of(spec.model, moe=True)
    out = {}
    for name, backward in (("forward", False), ("backward", True)):
        t = block_times(sh, spec.train.micro_batch_size, spec.seq_len, device, backward=backward, **kw)
        sync = 0.0 if backward else sync_seconds(assume.ep_dispatcher, us, sh.capacity_factor is not None)
        out[name] = dict(kernels=float(t.kernels), busy=float(t.busy), host=float(t.kernels) * us * 1e-6,
                         sync=sync, overhead=float(t.overhead))
    return out


def row_report(num: int, name: str, command: str, pubs: list[dict], host_us: float | None) -> dict:
    """One row: its spec's tokens per GPU and step, xpar's and the published step seconds, the MoE block's host
    and busy seconds; {'refusal': ...} where the command is refused."""
    spec, refusal = build(command)
    if spec is None:
        return dict(num=num, name=name, refusal=refusal)
    assume = assumptions_for(spec)
    est = estimate(spec, assume)
    tokens = spec.train.global_batch_size * spec.seq_len / spec.world_size
    pub = next((float(p["published"]) for p in pubs if p["metric"] == "tokens_per_s_gpu"), None)
    return dict(num=num, name=name, tokens=tokens, step=est.time_per_step_s, host_op_us=assume.host_op_us,
                published_step=tokens / pub if pub else None, block=moe_block_host(spec, assume, host_us))


def print_row(r: dict, host_us: float | None) -> None:
    """The row's lines: the step, then per pass the kernels, busy, host (and what-if host) and sync in ms."""
    if "block" not in r:
        print(f"#{r['num']:<3} {r['name'][:50]}: refused ({r.get('refusal')})")
        return
    pub = f"{r['published_step']:.3f} s" if r["published_step"] else "none"
    print(f"#{r['num']:<3} {r['name'][:50]}: {r['tokens']:,.0f} tokens/GPU a step; xpar {r['step']:.3f} s, "
          f"published {pub}")
    for name, b in r["block"].items():
        what = f" at {host_us:g} us" if host_us is not None else f" at {r['host_op_us']:g} us"
        print(f"     MoE block {name:8s} {b['kernels']:4.0f} kernels  busy {1e3 * b['busy']:7.3f} ms  "
              f"host{what} {1e3 * b['host']:7.3f} ms  sync {1e3 * b['sync']:6.3f} ms  "
              f"host/busy {b['host'] / b['busy']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hunt", type=Path, required=True, help="a hunt's markdown (its Runs table)")
    ap.add_argument("--rows", default=None, help="row numbers, e.g. 22-25 (default: every MoE row with a command)")
    ap.add_argument("--pair", default=None, help="two rows of one layout, e.g. 24,25: fixed and per-token parts")
    ap.add_argument("--host-us", type=float, default=None, help="what-if host microseconds per kernel")
    args = ap.parse_args()
    if not args.hunt.exists():
        refuse(f"--hunt {args.hunt}: no such file; values that work: benchmarks/refusal_hunt3.md")
    pubs, keep = published(sidecar_for(args.hunt)), row_set(args.rows) if args.rows else None
    reports = {}
    for num, name, command in runs_table(args.hunt):
        if keep is None or num in keep or (args.pair and str(num) in args.pair.split(",")):
            try:
                reports[num] = row_report(num, name, command, pubs.get(num, []), args.host_us)
            except ValueError as e:
                reports[num] = dict(num=num, name=name, refusal=str(e))
            print_row(reports[num], args.host_us)
    if args.pair:
        print_pair(reports, args.pair)


def print_pair(reports: dict, pair: str) -> None:
    """The fixed and per-token parts of the two rows ``pair`` names, published and xpar's.

    Raises:
        SystemExit: code 2, ``pair`` is not two scored rows (one line)."""
    nums = [int(x) for x in pair.split(",") if x.strip().isdigit()]
    if len(nums) != 2 or any("block" not in reports.get(n, {}) or not reports[n]["published_step"] for n in nums):
        refuse(f"--pair {pair}: needs two accepted rows with a published tokens_per_s_gpu; values that work: 24,25")
    a, b = (reports[n] for n in nums)
    for label, key in (("published", "published_step"), ("xpar", "step")):
        fixed, per = split_fixed(a["tokens"], a[key], b["tokens"], b[key])
        print(f"pair #{nums[0]},#{nums[1]} {label:9s}: fixed {fixed:.3f} s a step ({100 * fixed / a[key]:.0f} % "
              f"of #{nums[0]}), {1e6 * per:.1f} us a token")


if __name__ == "__main__":
    main()
