"""Prints the torchrun environment contract and the arguments of the worker it runs in, one line:
what tests/launch/conformance_test.cpp compares between torchrun and paratrain launch."""
import os
import sys
import time

PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_",
            "OMP_NUM_THREADS", "TORCH_NCCL_", "PYTHONUNBUFFERED")
keys = sorted(k for k in os.environ if k.startswith(PREFIXES))
# One write of the whole line: under torchrun (PYTHONUNBUFFERED=1) print() writes the text and its
# newline apart, and the workers share one pipe, so two lines could run together.
line = ("ENV " + " ".join("%s=%s" % (k, os.environ[k]) for k in keys) + " ARGS=" +
        ",".join(sys.argv[1:]) + "\n")
data = line.encode()
while data:
    data = data[os.write(1, data):]
if os.environ.get("FAIL_FIRST") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    time.sleep(3)  # every worker prints before the first failure stops the others
    sys.exit(3)
