"""``--search optuna``: a multi-objective search (latency, energy, area) over a space too large for a
grid: Legions, cores per Legion, array size and the four scratchpads, each a power of two within a
range set by the base machine.

Trials are asked in batches as wide as the executor, measured together, and told in the order they
were asked, so a seed gives the same trials whatever order the batch finishes in (and a resumed
search, reading its measurements back from the store, asks the same ones again).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import replace

from isa import arch as arch_mod
from dlegion_cc.dse_measure import Config, config_of

OBJECTIVES = ("time_us", "energy_uj", "area_mm2")
SAMPLERS = ("tpe", "nsga2")
SCRATCHPADS = ("act_kib", "wgt_kib", "acc_kib", "vec_kib")
MAX_LEGIONS = 64        # the multicast set is a 64-bit mask (isa.arch)


def space(base: arch_mod.Arch) -> dict[str, tuple[int, int]]:
    """Each parameter's range of powers of two, as (lowest, highest) exponents: Legions and cores
    from 1 to twice the base's, arrays from 4 x 4 (the smallest whose w4 rows are whole bytes at
    every size up) to twice the base's, scratchpads from a quarter to twice the base's."""
    def log2(v: int) -> int:
        return int(math.log2(v))
    ranges = {"legions": (0, min(log2(2 * base.legions), log2(MAX_LEGIONS))),
              "cores": (0, log2(2 * base.cores)),
              "array": (2, max(2, log2(2 * base.array)))}
    for s in SCRATCHPADS:
        kib = getattr(base, s)
        ranges[s] = (max(0, log2(kib) - 2), log2(kib) + 1)
    return ranges


def name_of(base: arch_mod.Arch, p: dict[str, int]) -> str:
    """As the grid names machines, plus each scratchpad that differs from the base's."""
    spads = "".join(f"-{s.removesuffix('_kib')}{p[s]}" for s in SCRATCHPADS if p[s] != getattr(base, s))
    return f"L{p['legions']}-c{p['cores']}-a{p['array']}{spads}"


def config_for(base: arch_mod.Arch, p: dict[str, int]) -> Config:
    name = name_of(base, p)
    try:
        machine = replace(base, name=name, description=f"{base.name} with {p}", **p)
    except arch_mod.ArchError as e:
        return Config(name, p["legions"], p["cores"], p["array"], None, str(e))
    return config_of(machine)


def sampler_of(name: str, seed: int, trials: int):
    import optuna
    if name == "nsga2":
        # A population a quarter of the trials (at least 4, at most Optuna's 50): some generations
        # evolve even in a short search.
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=min(50, max(4, trials // 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                          n_startup_trials=min(10, max(2, trials // 3)))


def search(sweep, base: arch_mod.Arch, trials: int, seed: int, sampler: str, batch: int) -> list[dict]:
    """Measure ``trials`` machines chosen by ``sampler``; a row per distinct machine."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["minimize"] * len(OBJECTIVES), sampler=sampler_of(sampler, seed, trials))
    ranges = space(base)
    rows: dict[str, dict] = {}
    while len(study.trials) < trials:
        asked = [study.ask() for _ in range(min(batch, trials - len(study.trials)))]
        configs = [config_for(base, {k: 2 ** t.suggest_int(k, *r) for k, r in ranges.items()}) for t in asked]
        fresh = [c for c in dict.fromkeys(configs) if c.name not in rows]     # a machine asked again is told again
        for row in sweep.measure(fresh, "optuna", say_known=False):
            rows[row["name"]] = row
        for t, c in zip(asked, configs):
            _tell(study, t, rows[c.name])
    return list(rows.values())


def _tell(study, trial, row: dict) -> None:
    import optuna
    if row["status"] != "ok":
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    study.tell(trial, [row[o] for o in OBJECTIVES])
