#!/bin/bash
# Device check, 2026-11-29, the second call (the same machine, warm): the rest of the suite
# again with 14 xdist processes and -v (the first call's -n 8 run had one F and stopped at its
# 170-s timeout before naming it). It stopped at its 290-s timeout too, at 71%, before
# pytest printed the failures' tracebacks: pytest_rest_n14.txt (pytest_rest2.txt, its
# pytest-benchmark warnings dropped) names them only.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
timeout 290 python3 -m pytest -v -n 14 -p no:cacheprovider -p no:benchmark --ignore=tests/test_cluster.py -m "not gpu" -rfE > $OUT/pytest_rest2.txt 2>&1
