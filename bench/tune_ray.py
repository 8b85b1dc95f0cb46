#!/usr/bin/env python3
"""Ray Tune's side of `paratrain bench tune`, on the same search, budget, seed and trial
concurrency as paratrain's (bench/tune.cpp), trained as paratrain's trials are
(bench/tune_common.py):

  asha  ASHAScheduler (grace period 1, reduction factor 4: Ray's defaults, as paratrain's) with
        random search (BasicVariantGenerator seeded)
  bohb  TuneBOHB with HyperBandForBOHB (reduction factor 3), which pauses trials at its rungs:
        they checkpoint each report and resume from it
  pbt   PopulationBasedTraining (Ray's defaults: quantile 0.25, resample probability 0.25) on
        the PBT case: --trials trials (the population) from random search, each to --quarters,
        perturbed every --perturbation-interval quarters; a trial that exploits restores
        another's checkpoint

Ray runs on this machine alone: --concurrent CPUs, no dashboard, no usage reporting, its
workers' output kept from the driver, its workers reused between trials (reuse_actors). Prints
one JSON row: best_accuracy (the best trial that ran to the end, at its last report), epochs_used
(quarter epochs reported, over 4), wall_seconds (Tuner.fit), startup_seconds (ray.init)."""
import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import warnings

# Before Ray is imported: nothing leaves the machine, and no dashboard is started.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray import tune  # noqa: E402

import tune_common as tc  # noqa: E402


def trial_index():
    # The number of the trial's experiment tag ("trainable_3e2cdc69_4_batch=256,..."): the
    # trial's place in the search, the model's seed as paratrain's trial number is (Ray's trial ids
    # are random under a searcher).
    name = os.path.basename(tune.get_context().get_trial_dir().rstrip("/"))
    return int(re.search(r"_(\d+)_[a-z]+=", name).group(1))


def trainable(config, data=None, seed=0, quarters=8, checkpoints=False):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    xtr, ytr, xte, yte = (torch.from_numpy(x) for x in data)
    trial_seed = seed * 1000 + trial_index()
    torch.manual_seed(trial_seed)
    model = tc.mlp(config["hidden"], config["dropout"])
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    done = 0
    start = tune.get_checkpoint()
    if start:
        with start.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = state["quarter"]
        for group in opt.param_groups:  # the checkpoint's lr is its source's; PBT changed ours
            group["lr"] = config["lr"]
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = config["dropout"]
    for q in range(done + 1, quarters + 1):
        tc.train_quarter(model, opt, xtr, ytr, config["batch"], trial_seed, q)
        metrics = {"accuracy": tc.accuracy(model, xte, yte), "quarter": q}
        if not checkpoints:
            tune.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "quarter": q},
                       os.path.join(d, "state.pt"))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


class CountResults(tune.Callback):
    """The quarter epochs trained: one per result of any trial."""

    def __init__(self):
        self.results = 0

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results += 1


def search(a):
    """The scheduler, the searcher, and whether trials checkpoint, for --system."""
    from ray.tune.schedulers import (ASHAScheduler, HyperBandForBOHB,
                                     PopulationBasedTraining)
    from ray.tune.search.basic_variant import BasicVariantGenerator
    if a.system == "asha":
        return (ASHAScheduler(time_attr="training_iteration", max_t=a.quarters,
                              grace_period=1, reduction_factor=4),
                BasicVariantGenerator(random_state=a.seed), False)
    if a.system == "bohb":
        from ray.tune.search.bohb import TuneBOHB
        return (HyperBandForBOHB(time_attr="training_iteration", max_t=a.quarters,
                                 reduction_factor=3),
                TuneBOHB(seed=a.seed), True)
    mutations = {"lr": tune.loguniform(*tc.LR), "batch": tc.BATCHES,
                 "dropout": tune.uniform(*tc.DROPOUT)}
    return (PopulationBasedTraining(time_attr="training_iteration",
                                    perturbation_interval=a.perturbation_interval,
                                    hyperparam_mutations=mutations),
            BasicVariantGenerator(random_state=a.seed), True)


def fit(a, data, scratch):
    """Ray started with its temporary files and results under `scratch`, the search run: the
    results, the result counter, Tuner.fit's seconds and ray.init's."""
    t0 = time.perf_counter()
    ray.init(num_cpus=a.concurrent, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", _temp_dir=os.path.join(scratch, "ray"))
    startup = time.perf_counter() - t0
    scheduler, searcher, checkpoints = search(a)
    counter = CountResults()
    space = {"lr": tune.loguniform(*tc.LR), "batch": tune.choice(tc.BATCHES),
             "hidden": tune.choice(tc.HIDDEN), "dropout": tune.uniform(*tc.DROPOUT)}
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(trainable, data=data, seed=a.seed, quarters=a.quarters,
                                 checkpoints=checkpoints),
            {"cpu": 1}),
        param_space=space,
        tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=a.trials,
                                    scheduler=scheduler, search_alg=searcher,
                                    max_concurrent_trials=a.concurrent,
                                    # Ray's advice for PBT and Hyperband, which pause and
                                    # restart trials: a trial's worker process is kept for the
                                    # next, as paratrain's trials are threads of one process.
                                    reuse_actors=True),
        # The budget as paratrain's max_t: a trial ends at its last quarter. Without a stopper
        # PBT takes that last report for a perturbation point, and a trial of the bottom quantile
        # there goes back to the source's checkpoint and trains past the budget.
        run_config=tune.RunConfig(storage_path=os.path.join(scratch, "results"), name="bench",
                                  verbose=0, callbacks=[counter],
                                  stop={"training_iteration": a.quarters}))
    start = time.perf_counter()
    results = tuner.fit()
    return results, counter, time.perf_counter() - start, startup


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["asha", "bohb", "pbt"], required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=20, help="trials; the population for pbt")
    p.add_argument("--quarters", type=int, default=8, help="quarter epochs a trial runs at most")
    p.add_argument("--perturbation-interval", type=int, default=2, help="pbt, in quarters")
    p.add_argument("--concurrent", type=int, default=2, help="trials at once, one CPU each")
    p.add_argument("--train-images", type=int, default=60000)
    p.add_argument("--test-images", type=int, default=10000)
    p.add_argument("--data-dir", default=tc.DATA_DIR)
    a = p.parse_args()
    random.seed(a.seed)  # PBT's exploit and explore draw from Python's random
    np.random.seed(a.seed)
    data = tc.load(a.train_images, a.test_images, a.data_dir)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-ray-") as scratch:
        results, counter, wall, startup = fit(a, data, scratch)
        finished = [r.metrics["accuracy"] for r in results
                    if r.metrics and r.metrics.get("quarter", 0) >= a.quarters]
        errors = [str(r.error) for r in results if r.error]
        ray.shutdown()  # before its temporary folder goes
    if errors:
        print(f"Ray Tune: {len(errors)} trial(s) failed; the first: {errors[0]}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"best_accuracy": max(finished, default=0.0),
                      "epochs_used": counter.results / 4, "wall_seconds": wall,
                      "startup_seconds": startup, "ray": ray.__version__}))


if __name__ == "__main__":
    main()
