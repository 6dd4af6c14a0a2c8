# Optimus: the paper's experiments as one DAG. Thin on purpose: the runs are declared in
# workflow/experiments.py, the rules in workflow/rules/, the settings in workflow/config/.
#   snakemake --profile workflow/profiles/laptop            (make reproduce)
#   snakemake --profile workflow/profiles/laptop -n         (the DAG, nothing run)
from snakemake.utils import validate

configfile: "workflow/config/laptop.yaml"
validate(config, "workflow/config/schema.yaml")

include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/scaling.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        REPORT,
        FIGURES,
