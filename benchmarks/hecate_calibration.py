"""Hecate's calibration rules at paper scale: SIMULATED on hecate_A (16 GPUs, 32 experts), the reproduction's
upsampled REAL traces, each Table 1 model; Hecate at the formula's t (the headline system) and at the t_paper
chosen from Fig. 13 (a labelled variant), each with the
spec's calibration rule ``all_slots`` (t_cal = every free slot: all or nothing) and with ``best`` (the fastest
t_cal of 1..free slots by the cost model, ``calibration_rule: best``).

Printed per (model, variant): the mean simulated iteration's speedup over EP, without the policy's time (as the
reproduction's figures, which must not depend on the host) and with this CPU's calibration time on every rank's
path before each dispatch (``time_policy``: ``thread_time`` per layer call, priced as a REAL run's record is); the
layer calls whose calibration was accepted; the calibration's and the whole policy's (Alg. 1 too, which runs
ahead of the layer and is not priced) CPU ms per layer call beside the simulated MoE layer. m = E (memory does not
bind at batch 1, as in the reproduction's Fig. 9).

Usage: python benchmarks/hecate_calibration.py [--scale default] [--models GPT-MoE-S GPT-MoE-L BERT-MoE BERT-MoE-Deep]
"""
from __future__ import annotations

import argparse
import sys
import time

RULES = ("all_slots", "best")


def main(argv=None) -> int:
    from moelab.papers.hecate.common import PAPER_MODELS, assumptions, scale_spec
    from moelab.papers.hecate.end_to_end import T_CHOSEN, simulate_system, system_plans
    from moelab.papers.hecate.paper_scale import paper_config, paper_loads, paper_profile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", default="default", choices=("smoke", "default", "full"))
    p.add_argument("--models", nargs="*", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    a = p.parse_args(argv)
    prof = paper_profile("hecate_A", 16)
    print(f"# SIMULATED on hecate_A, 16 GPUs; traces: the {a.scale} scale's REAL routing upsampled (reproduction kit); "
          f"t_paper = {assumptions().value('t_paper')} (an assumption), m = E")
    print(f"{'model':14s} {'system':36s} {'rule':9s} {'speedup':>7s} {'priced':>7s} {'accepted':>12s} "
          f"{'calib ms/call':>13s} {'policy ms/call':>14s} {'sim MoE layer ms':>16s}")
    for model in a.models:
        loads = paper_loads(scale_spec(a.scale).name, model, "hecate_A", 16, 0)
        cfg = paper_config(model, prof, layers=loads.shape[1], batch=int(assumptions().value("batch_per_gpu")))
        c, plans, _ = system_plans("EP", cfg, prof, loads)
        ep = simulate_system(c, prof, loads, plans).iter_s.mean()
        for system, rule in ((s, r) for s in (T_CHOSEN, "Hecate") for r in RULES):
            t0 = time.thread_time()
            c, plans, _ = system_plans(system, cfg, prof, loads, calibration_rule=rule, time_policy=True)
            cpu = time.thread_time() - t0
            calls = loads.shape[0] * loads.shape[1]
            calib = sum(sum(p["policy_s"]) for p in plans) / calls
            priced = simulate_system(c, prof, loads, plans)
            df = simulate_system(c, prof, loads, [{k: v for k, v in p.items() if k != "policy_s"} for p in plans])
            moe = df.moe_s.mean() / loads.shape[1]
            # an accepted calibration is a call whose final holders differ from the gathered ones
            acc = f"{sum(h != q for p in plans for h, q in zip(p['holders'], p['prefetch']))} of {calls}"
            print(f"{model:14s} {system:36s} {rule:9s} {ep / df.iter_s.mean():6.2f}x {ep / priced.iter_s.mean():6.2f}x "
                  f"{acc:>12s} {1e3 * calib:13.2f} {1e3 * cpu / calls:14.2f} {1e3 * moe:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
