#!/usr/bin/env python3
"""Optuna's side of `paratrain bench tune`: the same search as paratrain's (the mlp on
Fashion-MNIST, lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden choice(128, 256,
512), dropout uniform(0, 0.5); at most 2 epochs a trial, test accuracy reported every quarter
epoch; 1 thread), trained as paratrain's trials are (bench/tune_common.py). Runs with Debian's
python3-optuna 3.1 and with PyPI's current Optuna. Prints one JSON row."""
import argparse
import json
import time

import optuna
import torch

import tune_common as tc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default=tc.DATA_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    p.add_argument("--pruner", choices=["hyperband", "none"], default="hyperband")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--quarters", type=int, default=8, help="quarter epochs a trial runs at most")
    # The first N images only (paratrain bench tune --smoke): an epoch is then a pass over them.
    p.add_argument("--train-images", type=int, default=60000)
    p.add_argument("--test-images", type=int, default=10000)
    a = p.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    xtr, ytr, xte, yte = (torch.from_numpy(x) for x in
                          tc.load(a.train_images, a.test_images, a.data_dir))
    used = [0]

    def objective(trial):
        lr = trial.suggest_float("lr", *tc.LR, log=True)
        batch = trial.suggest_categorical("batch", tc.BATCHES)
        hidden = trial.suggest_categorical("hidden", tc.HIDDEN)
        dropout = trial.suggest_float("dropout", *tc.DROPOUT)
        trial_seed = a.seed * 1000 + trial.number
        torch.manual_seed(trial_seed)
        model = tc.mlp(hidden, dropout)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        acc = 0.0
        for q in range(1, a.quarters + 1):
            tc.train_quarter(model, opt, xtr, ytr, batch, trial_seed, q)
            acc = tc.accuracy(model, xte, yte)
            used[0] += 1
            trial.report(acc, q)
            if a.pruner == "hyperband" and trial.should_prune():
                raise optuna.TrialPruned()
        return acc

    sampler = (optuna.samplers.TPESampler(seed=a.seed) if a.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=a.seed))
    pruner = (optuna.pruners.HyperbandPruner(min_resource=1, max_resource=a.quarters,
                                             reduction_factor=3)
              if a.pruner == "hyperband" else optuna.pruners.NopPruner())
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    start = time.perf_counter()
    study.optimize(objective, n_trials=a.trials, n_jobs=1)
    wall = time.perf_counter() - start
    print(json.dumps({"best_accuracy": study.best_value, "epochs_used": used[0] / 4,
                      "wall_seconds": wall, "optuna": optuna.__version__}))


if __name__ == "__main__":
    main()
