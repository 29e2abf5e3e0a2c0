"""W10's learning check: a DPO curve against the stock DPO curve of the same run, at the noise
floor that the run's other correct implementations of the same loss show.

Why not SFT's rule (every step within 2% of the stock curve): a DPO loss starts at log 2 and
falls towards 0, and in bf16 with AdamW the implementations part after the first update (Adam's
first step is close to lr * sign(grad), so a bf16 rounding that flips a near-zero gradient's sign
moves that weight by a whole lr). On the H200 (2026-12-02, 489a924), TRL's DPOTrainer with and
without Liger's layer kernels -- the same trainer, the same loss -- were 5% apart at the second
step and 47% apart at the sixth; Liger's fused DPO loss was 81% from plain TRL at one step. A 2%
band there measures rounding, not learning. Exact parity is shown elsewhere, in fp32, where the
implementations agree: `tests/gpu/test_preference_parity_gpu.py` (each of 30 steps within 2% of
TRL's DPOTrainer, margins within 5%, LoRA weights at the end).

The rule here, for a curve `ours` against `stock` with the run's `others` (the other
implementations of the same loss, same batches, same seeds):
- ours falls like the stock curve (within FALL_TOL of its fall, as for SFT), and
- ours' mean absolute distance from the stock curve over the steps is no larger than the largest
  such distance among `others`: ours is no farther from TRL than a correct implementation is.
With no other implementation in the run, SFT's strict rule applies (bench.report.learning_check).
"""

from __future__ import annotations

from bench.report import FALL_TOL, MIN_FALL, MIN_STEPS, _finite_curve, learning_check


def mean_abs_gap(a: list[float], b: list[float]) -> float:
    """Mean over the steps of |a - b| (nats); the curves must have the same length."""
    if len(a) != len(b):
        raise ValueError(f"curves of {len(a)} and {len(b)} steps")
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def dpo_check(ours: list[float] | None, stock: list[float] | None, others: dict[str, list[float]]) -> dict:
    """{"verdict": "ok" | "FAILED" | "none", "reason": str, ...numbers} for a DPO curve."""
    usable = {name: c for name, c in others.items() if _finite_curve(c) and stock is not None and len(c) == len(stock)}
    if not usable:
        out = learning_check(ours, stock)
        return dict(out, rule="strict: no other implementation in the run")
    out = learning_check(ours, stock, step_tol=float("inf"))  # the fall, the steps, the stock fall
    out["rule"] = "noise floor of the run's other implementations"
    if out["verdict"] != "ok":
        return out
    gap = mean_abs_gap(ours, stock)
    floor_name, floor = max(((n, mean_abs_gap(c, stock)) for n, c in usable.items()), key=lambda t: t[1])
    out.update(mean_abs_gap=gap, floor=floor, floor_impl=floor_name)
    if gap > floor:
        return dict(
            out,
            verdict="FAILED",
            reason=f"mean distance from the stock curve {gap:.4f} nats, more than {floor_name}'s {floor:.4f}",
        )
    return dict(
        out,
        verdict="ok",
        reason=f"fell {out['ours_fall']:.3f} nats (stock {out['stock_fall']:.3f}); mean distance from the "
        f"stock curve {gap:.4f} nats, within the run's floor ({floor_name} {floor:.4f})",
    )


def dpo_verdict(rec: dict, records, counts_anyway: bool) -> dict:
    """W10's verdict for one record (bench.report.learning_verdict), against trl_dpo of its run.
    Ours is held to the run's noise floor (its other DPO curves, dpo_check); a peer, which is part
    of that floor, only to the stock fall."""
    from bench.report import _same_run

    same = [
        r for r in records if r is not rec and _same_run(r, rec) and r.get("status") == "ok" and r.get("loss_curve")
    ]
    stock = next((r for r in same if r.get("impl") == "trl_dpo"), None)
    if stock is None:
        run = rec.get("run_id") or "?"
        return {"verdict": "none", "counts": counts_anyway, "reason": f"no trl_dpo curve in run {run}"}
    if rec.get("impl") != "ours":
        c = learning_check(rec["loss_curve"], stock["loss_curve"], step_tol=float("inf"))
        c["reason"] = f"fall only (the peers are the floor ours is held to): {c['reason']}"
    else:
        others = {r["impl"]: r["loss_curve"] for r in same if r.get("impl") not in ("trl_dpo", "ours")}
        c = dpo_check(rec["loss_curve"], stock["loss_curve"], others)
    label = {"ok": "ok", "FAILED": "FAILED", "none": "no learning check"}[c["verdict"]]
    counts = counts_anyway or c["verdict"] == "ok"
    return dict(c, reference="trl_dpo", counts=counts, reason=f"{label} vs trl_dpo: {c['reason']}")


__all__ = ["FALL_TOL", "MIN_FALL", "MIN_STEPS", "dpo_check", "dpo_verdict", "mean_abs_gap"]
