#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu tests/optimus_core/train/test_update_stream.py -p no:cacheprovider -k "not True" > $OUT/tests.log 2>&1
tail -1 $OUT/tests.log
timeout 200 python3 bench/train_step.py --store '' --out $OUT --variants 7b8l-triton+compile 7b8l-triton+compile-beside 7b8l-triton+compile+graphs > $OUT/train-step.log 2>&1
grep -a "b2b\|   7b8l" $OUT/train-step.log | cut -c1-200
python3 -m pip install -q --no-index --no-deps --target /tmp/peers-site .peers/.whl/*.whl
(cd .peers && PYTHONPATH=/tmp/peers-site timeout 120 python3 olmo_core_step.py --layers 8 > $OUT/olmo-core.jsonl 2> $OUT/olmo-core.log)
python3 bench/train_step.py --store '' --out $OUT --summarize-only --olmo-core-jsonl $OUT/olmo-core.jsonl >> $OUT/train-step.log 2>&1
grep -a "ratio\|olmo_core_tokens\|memory" $OUT/train-step.log | tail -8
