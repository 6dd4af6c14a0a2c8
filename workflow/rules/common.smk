# Shared names. The runs come from the registry (workflow/experiments.py), never from here.
from workflow.experiments import pretraining

SCALE = config["scale"]
RES = config["results"]
STORE = f"{RES}/store.zarr"
CORPUS = f"{RES}/data/corpus"
TOKENS = f"{RES}/data/tokens"
PRETRAIN_RUNS = {e.run_id(SCALE): e for e in pretraining()}
FIGURE_NAMES = ["loss", "heldout", "throughput", "expert_load"]
FIGURES = expand(f"{RES}/figures/{{name}}.png", name=FIGURE_NAMES)
REPORT = f"{RES}/report.md"

# The store is shared by every run (one group each, one writer per group), so it is not a
# declared file: each stage declares a marker it writes last (summary.json, eval.json).
wildcard_constraints:
    run="[A-Za-z0-9_.@-]+",
