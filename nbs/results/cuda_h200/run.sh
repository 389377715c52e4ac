#!/bin/bash
# One device call: the CUDA tests, lm-depth-gpu for as long as the call allows, then `transject-nb bench` on CUDA.
# Everything it reports lands in $OUT (machine.txt, tests.log, study.log, studies.db, trials.csv, runs.csv, bench.log,
# bench_cuda.csv). Dry run here: OUT=/tmp/o PLAN=lm-depth DEVICE=cpu DEADLINE=60 LIMIT=120 bash .gpu/run.sh
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
LIMIT=${LIMIT:-540}          # seconds this script may take in all
DEADLINE=${DEADLINE:-420}    # seconds from its start at which the study is stopped (its storage keeps what finished)
PLAN=${PLAN:-lm-depth-gpu}; WORKERS=${WORKERS:-14}; DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TRANSJECT_CACHE=/tmp/tjcache
TJ="$PY -W ignore::FutureWarning -c 'from transject_nb.training.cli import main; main()'"
WHL=${WHL:-.whl}
if [ -d "$WHL" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else export PYTHONPATH=$PWD; fi
DATA=/tmp/tjdata; mkdir -p $DATA/imdb; cp -r .gpu/data/bert-base-uncased $DATA/
$PY -c "
import lzma, shutil, sys
from concurrent.futures import ThreadPoolExecutor
def un(s):
    with lzma.open(f'.gpu/data/imdb/{s}.csv.xz') as a, open(f'$DATA/imdb/{s}.csv', 'wb') as b: shutil.copyfileobj(a, b)
list(ThreadPoolExecutor(3).map(un, ('train', 'test', 'unsup')))" || exit 1
{ nvidia-smi -L; nproc --all; $PY -c "import torch, fastai, optuna, transject_nb; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'fastai', fastai.__version__, 'optuna', optuna.__version__, 'transject_nb', transject_nb.__version__)"; echo "ready at $(el) s"; } 2>&1 | tee "$OUT/machine.txt"

# the corpus, built once before any worker starts (each would build it), beside the CUDA tests
$PY -W ignore -c "
from transject_nb.lab.studies import study_plan; from transject_nb.lab.protocol_workers import plan_data
c = plan_data(study_plan('$PLAN'), '$DATA'); print('corpus key', c.key, 'documents', len(c.train), len(c.valid), len(c.test))" >> "$OUT/machine.txt" 2>&1 &
CORPUS=$!
if [ "$DEVICE" = cuda ] && [ "${TESTS:-1}" = 1 ]; then
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_models.py tests/test_baselines.py tests/test_validation.py \
    tests/test_lm.py tests/test_learner.py tests/test_finetune.py -k cuda > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at $(el) s" | tee -a "$OUT/tests.log"
fi
wait $CORPUS; echo "corpus rc=$? at $(el) s" | tee -a "$OUT/machine.txt"

# the study, in a session of its own so that its workers stop with it
setsid bash -c "$TJ study $PLAN --workers $WORKERS --threads 1 --data $DATA --storage /tmp/lm-gpu.db ${START:+--start-from $START} --out /tmp/lm-gpu-runs ${STUDY_ARGS:-}" > "$OUT/study.log" 2>&1 &
SPID=$!
while kill -0 $SPID 2>/dev/null && [ "$(el)" -lt "$DEADLINE" ]; do sleep 5; done
if kill -0 $SPID 2>/dev/null; then
  echo "study stopped at the deadline, $(el) s" | tee -a "$OUT/study.log"
  kill -9 -- -$SPID 2>/dev/null; sleep 2   # killed trials stay RUNNING: a later sitting retries them (heartbeat)
else echo "study finished at $(el) s" | tee -a "$OUT/study.log"; fi
eval "$TJ study $PLAN --storage /tmp/lm-gpu.db --snapshot $OUT/studies.db" >> "$OUT/study.log" 2>&1
eval "$TJ study $PLAN --storage $OUT/studies.db --export $OUT" >> "$OUT/study.log" 2>&1
eval "$TJ study $PLAN --storage $OUT/studies.db --status" >> "$OUT/study.log" 2>&1
echo "exported at $(el) s" | tee -a "$OUT/study.log"

# the benchmark, on the idle GPU, with what is left
left=$(( LIMIT - $(el) - 10 ))
if [ "$DEVICE" = cuda ] && [ "${BENCH:-1}" = 1 ] && [ $left -gt 30 ]; then
  timeout $left bash -c "$TJ bench --device cuda --variants transject,random-transject,transformer --kernels readable --n 256,1024,4096 --csv $OUT/bench_cuda.csv" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at $(el) s" | tee -a "$OUT/bench.log"
fi
