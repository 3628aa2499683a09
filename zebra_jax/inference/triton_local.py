"""Runs an exported Triton model repository with the `tritonserver` binary
that the `nvidia-pytriton` wheel carries (Triton 2.51, its Python backend and
one backend stub per Python version), on this machine's Python.

  pip install nvidia-pytriton==0.7.0 --no-deps   # the binary; keeps numpy 2
  python -m zebra_jax.inference.triton_local --model-repository=DIR \
      [--http-port=8000] [--grpc-port=8001]

The Python backend runs model.py in a stub process linked against
libpython3.X. This module assembles a backend directory holding the stub for
the running Python's version, and points the stub at this interpreter: its
shared libpython first on LD_LIBRARY_PATH, the wheel's own libraries after
it, and this environment's site-packages (jax, numpy, flatbuffers) in
ZEBRA_JAX_TRITON_PATH, which model.py adds to sys.path (the stub's
interpreter does not read PYTHONPATH, so a virtual environment's packages
would be invisible to it).
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig


class NotAvailable(RuntimeError):
  """tritonserver cannot run here; the message says why in one line."""


def _dist():
  # Found, not imported: only the files are used (pytriton's own Python
  # API needs packages this does not).
  spec = importlib.util.find_spec("pytriton")
  if spec is None or not spec.submodule_search_locations:
    raise NotAvailable("nvidia-pytriton is not installed: pip install "
                       "nvidia-pytriton==0.7.0 --no-deps")
  root = os.path.abspath(list(spec.submodule_search_locations)[0])
  server = os.path.join(root, "tritonserver")
  libs = os.path.join(os.path.dirname(root), "nvidia_pytriton.libs")
  if not os.path.isdir(libs):
    libs = os.path.join(server, "external_libs")
  return server, libs


def prepare(workdir: str) -> tuple[str, str, dict]:
  """(tritonserver path, backend directory, environment) for this Python."""
  server, libs = _dist()
  version = f"{sys.version_info[0]}.{sys.version_info[1]}"
  stub = os.path.join(server, "python_backend_stubs", version,
                      "triton_python_backend_stub")
  if not os.path.exists(stub):
    raise NotAvailable(f"nvidia-pytriton has no Python backend stub for "
                       f"Python {version}")
  backends = os.path.join(workdir, "backends")
  if not os.path.isdir(backends):
    shutil.copytree(os.path.join(server, "backends"), backends)
    shutil.copy(stub, os.path.join(backends, "python",
                                   "triton_python_backend_stub"))
  env = dict(os.environ)
  libdir = sysconfig.get_config_var("LIBDIR") or ""
  paths = ([libdir] if sysconfig.get_config_var("Py_ENABLE_SHARED") else [])
  paths += [libs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
  env["LD_LIBRARY_PATH"] = ":".join(paths)
  site = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
  env["ZEBRA_JAX_TRITON_PATH"] = os.pathsep.join(site)
  env.setdefault("JAX_PLATFORMS", "cpu" if not _cuda_visible() else "")
  return os.path.join(server, "bin", "tritonserver"), backends, env


def _cuda_visible() -> bool:
  return shutil.which("nvidia-smi") is not None


def command(repository: str, workdir: str, http_port: int = 8000,
            grpc_port: int = 8001, metrics: bool = False):
  """(argv, env) of a tritonserver on 127.0.0.1 serving `repository`."""
  binary, backends, env = prepare(workdir)
  argv = [binary, f"--model-repository={os.path.abspath(repository)}",
          f"--backend-directory={backends}",
          "--http-address=127.0.0.1", f"--http-port={http_port}",
          "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
          f"--allow-metrics={str(metrics).lower()}",
          "--log-verbose=0", "--exit-on-error=true", "--exit-timeout-secs=10"]
  return argv, env


def check_runs(workdir: str) -> None:
  """NotAvailable when the binary cannot start here (e.g. an older glibc)."""
  binary, _, env = prepare(workdir)
  try:
    run = subprocess.run([binary, "--help"], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
  except OSError as e:
    raise NotAvailable(f"tritonserver cannot start: {e}") from None
  if "--model-repository" not in run.stdout + run.stderr:
    line = (run.stderr.strip().splitlines() or ["no output"])[-1]
    raise NotAvailable(f"tritonserver cannot start here: {line}")


def arrays(prompts, **fields) -> dict:
  """A request's input arrays by name: UTF-8 prompts as zero-padded UINT8
  rows with PROMPT_LENGTH, and sampling fields by their input names (any
  SamplingParams field in capitals, e.g. MAX_NEW_TOKENS=20, MIN_P=0.05,
  STOP=("\\n",)), each repeated per row; ValueError for an unknown name."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from zebra_jax import engine  # pylint: disable=g-import-not-at-top
  raw = [p.encode("utf-8") for p in prompts]
  data = np.zeros((len(raw), max([len(r) for r in raw] + [1])), np.uint8)
  for i, r in enumerate(raw):
    data[i, :len(r)] = np.frombuffer(r, np.uint8)
  out = {"PROMPT": data,
         "PROMPT_LENGTH": np.array([[len(r)] for r in raw], np.int32)}
  for name, value in fields.items():
    out[name] = engine.wire.rows(name, value, len(raw))
  return out


def request(prompts, **fields):
  """(inputs, outputs) for tritonclient.http's infer(): arrays()' tensors."""
  import tritonclient.http as th  # pylint: disable=g-import-not-at-top
  inputs = []
  for name, array in arrays(prompts, **fields).items():
    tensor = th.InferInput(name, list(array.shape),
                           th.np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array, binary_data=True)
    inputs.append(tensor)
  outputs = [th.InferRequestedOutput(n, binary_data=True)
             for n in ("TEXT", "TEXT_LENGTH", "BATCH_ROWS")]
  return inputs, outputs


def texts(result) -> list[str]:
  """The texts of an infer() result."""
  data, lengths = result.as_numpy("TEXT"), result.as_numpy("TEXT_LENGTH")
  return [bytes(row[:n]).decode("utf-8") for row, n in zip(data, lengths[:, 0])]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model-repository", required=True)
  parser.add_argument("--http-port", type=int, default=8000)
  parser.add_argument("--grpc-port", type=int, default=8001)
  parser.add_argument("--workdir", default=None,
                      help="where the backend directory goes (default: "
                      "next to the repository)")
  args = parser.parse_args(argv)
  workdir = args.workdir or os.path.join(
      os.path.dirname(os.path.abspath(args.model_repository)), "tritonserver")
  try:
    cmd, env = command(args.model_repository, workdir, args.http_port,
                       args.grpc_port)
  except NotAvailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.execve(cmd[0], cmd, env)
  return 0


if __name__ == "__main__":
  sys.exit(main())
