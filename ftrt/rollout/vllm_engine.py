"""The vLLM rollout engine (``ftrt rollout serve --engine vllm``): the job's policy served by vLLM.

The server talks HTTP to a vLLM OpenAI-compatible server, either one it starts itself
(``--vllm-python``: an interpreter with vLLM installed, which may be another virtual environment
than ftrt's) or one already running (``--vllm-url``). The job's policy must be a Hugging Face
causal LM (``model.hf_path``, present at the same path on the server's host).

- **Generation**: one request per sample, prompt as token ids, ``seed`` from the same counters as
  the built-in engine (``sample_seed(seed, step, prompt_id, j)``; one prompt per request, since
  several prompts of one request share one random stream), ``return_token_ids`` to get ids back.
- **Weights**: a push is written as ``model.safetensors`` into a folder of its own and loaded with
  vLLM's ``reload_weights`` (``collective_rpc``; needs ``VLLM_SERVER_DEV_MODE=1``) between
  ``/pause?mode=wait`` and ``/resume``, then the prefix cache is reset (it would hold states of
  the old weights). A reload that fails leaves vLLM's model broken (its next forward crashes the
  server), so on a failure the last good folder is reloaded at once and the push is refused.
  Every HTTP call has a timeout.
- **Guarantees**: exactly once, as for any engine (the trainer's ledger). Not bit-identical to a
  fault-free run: vLLM's CPU kernels are not batch-invariant. A stalled engine core still answers
  ``/health`` (vLLM's own processes stay up), so the trainer's request deadline is what catches it.

vLLM holds one weight version at a time (``max_versions = 1``): the trainer moves it to a newer
version only when no group of its current version is waiting.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import torch

from ftrt import tmpdirs
from ftrt.errors import ConfigError
from ftrt.policy.sample import make_prompts, sample_seed
from ftrt.policy.setting import build_setting
from ftrt.procs import descendants, die_with
from ftrt.rollout.engine import NO_VERSION, Held
from ftrt.policy.spec import PolicySpec
from ftrt.rollout.errors import EngineFailed, StaleVersion
from ftrt.rollout.weights import Expected, PushRefused, expected_of

log = logging.getLogger("ftrt.rollout.vllm")

SERVED_NAME = "ftrt-policy"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmEngine:
    """The job's policy in a vLLM server (see the module docstring)."""

    name = "vllm"
    max_versions = 1

    def __init__(self, spec: PolicySpec, *, url: str | None, python: str | None, workdir: Path,
                 timeout: float = 60.0, ready_timeout: float = 600.0, remove_workdir: bool = False) -> None:
        """``remove_workdir``: ``workdir`` is a temporary folder of :func:`ftrt.tmpdirs.owned_dir`,
        removed by :meth:`close`."""
        if not spec.model.hf_path:
            raise ConfigError("--engine vllm serves Hugging Face models only: the job's config must set "
                              "model.hf_path (the built-in TinyLM needs --engine builtin).")
        if bool(url) == bool(python):
            raise ConfigError("--engine vllm needs exactly one of --vllm-url (a running vLLM server) and "
                              "--vllm-python (an interpreter with vLLM, to start one).")
        self.spec = spec
        self.timeout = timeout
        built = build_setting(spec.model, spec.task, seed=spec.seed, max_new_tokens=spec.max_new_tokens)
        self.task, self.vocab, self.max_new, self.prompt_len = built.task, built.vocab, built.max_new, built.prompt_len
        self.expected: dict[str, Expected] = expected_of(built.model.state_dict())
        self.vocab_size = len(built.vocab)
        del built
        self.source = Path(spec.model.hf_path)
        self.workdir = workdir
        self._remove_workdir = remove_workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self._broken = ""
        self.url = (url or "").rstrip("/")
        if python:
            self.url = self._start(python, ready_timeout)
        else:
            self._wait_ready(ready_timeout)
        self.model_name = self._served_name()
        self._held = Held(NO_VERSION, "", None)
        self._good = str(self.source)  # the folder the model was last loaded from successfully
        self._lock = threading.Lock()

    # -- vLLM's process and HTTP --------------------------------------------------------------------
    def _start(self, python: str, ready_timeout: float) -> str:
        port = _free_port()
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.source),
               "--served-model-name", SERVED_NAME, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(max(self.prompt_len + self.max_new, 16)), "--seed", "0"]
        logf = open(self.workdir / "vllm.log", "ab")
        log.info("starting vLLM: %s (its log: %s)", " ".join(cmd), self.workdir / "vllm.log")
        try:
            # in this server's process group (a signal to the group reaches vLLM's own processes too),
            # and killed with this server even when it is SIGKILLed
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=partial(die_with, os.getpid()))
        except OSError as exc:
            raise ConfigError(f"--vllm-python {python}: cannot start it ({exc.strerror}).") from None
        finally:
            logf.close()
        url = f"http://127.0.0.1:{port}"
        self.url = url
        try:
            self._wait_ready(ready_timeout)
        except BaseException:  # not ready, or this server stopped meanwhile: leave no vLLM behind
            self.close()
            raise
        return url

    def _wait_ready(self, ready_timeout: float) -> None:
        start = time.monotonic()
        end, said = start + ready_timeout, start
        while time.monotonic() < end:
            if time.monotonic() - said >= 30:  # vLLM takes minutes to start on a CPU: say what is going on
                said = time.monotonic()
                log.info("waiting for vLLM at %s to answer (%.0f s of --vllm-ready-timeout %g s)%s", self.url,
                         said - start, ready_timeout, f"; its log: {self.workdir / 'vllm.log'}" if self.proc else "")
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineFailed(f"vLLM exited with code {self.proc.returncode} while starting; see "
                                   f"{self.workdir / 'vllm.log'}.")
            try:
                self._call("GET", "/v1/models", timeout=2.0)
                return
            except EngineFailed:
                time.sleep(1.0)
        raise EngineFailed(f"vLLM at {self.url} was not ready after {ready_timeout:g} s.")

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise EngineFailed(f"vLLM answered {method} {path} with HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise EngineFailed(f"vLLM at {self.url} did not answer {method} {path}: {exc}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise EngineFailed(f"vLLM answered {method} {path} with something that is not JSON.") from None

    def _served_name(self) -> str:
        models = self._call("GET", "/v1/models").get("data") or []
        if not models:
            raise EngineFailed(f"vLLM at {self.url} serves no model.")
        return str(models[0]["id"])

    def alive(self) -> bool:
        """vLLM is up and its weights are known (False once a weight change failed half-way)."""
        return not self._broken and (self.proc is None or self.proc.poll() is None)

    def close(self) -> None:
        """Stop the vLLM server this engine started, and every process it started; remove a
        temporary work folder."""
        self._stop_server()
        if self._remove_workdir:
            tmpdirs.remove(str(self.workdir))

    def _stop_server(self) -> None:
        if self.proc is None:
            return
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in family:  # vLLM's engine core and workers outlive a killed API server
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    # -- versions -------------------------------------------------------------------------------------
    @property
    def versions(self) -> dict[int, str]:
        h = self._held
        return {h.version: h.digest} if h.version != NO_VERSION else {}

    @property
    def newest(self) -> Held:
        return self._held

    def lookup(self, version: int, digest: str) -> Held | None:
        h = self._held
        return h if h.version == version and h.digest == digest else None

    def apply(self, version: int, digest: str, tensors: dict[str, torch.Tensor], keep_from: int) -> float:
        """Write the push as a folder and load it into vLLM (all or nothing; see the module docstring).

        While the weights change the engine holds no version (a group asked for meanwhile is
        refused). If vLLM cannot load them, the last good weights are loaded back and the push is
        refused; if even that fails, or vLLM fails after loading, the engine is broken: it stops
        (:meth:`alive` turns False and the server leaves the fleet) rather than serve weights it
        cannot name.
        """
        from safetensors.torch import save_file

        if self.lookup(version, digest) is not None:
            return 0.0  # the same version again (its first push's acknowledgement was lost)
        t0 = time.perf_counter()
        folder = self.workdir / f"v{version:08d}-{digest[:12]}"
        if folder.exists() and str(folder) != self._good:
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for f in self.source.iterdir():  # config, tokenizer, generation config: everything but weights
            if f.is_file() and not f.name.endswith(WEIGHT_FILES):
                shutil.copy2(f, folder / f.name)
        save_file({name.removeprefix("lm."): t.contiguous() for name, t in tensors.items()},
                  str(folder / "model.safetensors"))
        with self._lock:  # no group is sampled while the weights change
            previous, self._held = self._held, Held(NO_VERSION, "", None)
            try:
                self._call("POST", "/pause?mode=wait")
                try:
                    self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                           "kwargs": {"weights_path": str(folder)}})
                except EngineFailed as exc:
                    # a failed reload leaves vLLM's model broken: load the last good weights back at once
                    self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                           "kwargs": {"weights_path": self._good}})
                    self._call("POST", "/reset_prefix_cache", {})
                    self._call("POST", "/resume")
                    self._held = previous
                    shutil.rmtree(folder, ignore_errors=True)
                    raise PushRefused(f"vLLM could not load version {version} ({exc}); it serves version "
                                      f"{previous.version} still.") from None
                self._call("POST", "/reset_prefix_cache", {})
                self._call("POST", "/resume")
            except EngineFailed as exc:
                self._broken = f"vLLM failed while its weights changed: {exc}"
                log.error("%s; this engine stops", self._broken)
                raise
            old, self._good = self._good, str(folder)
            self._held = Held(version, digest, None)
        if old not in (str(self.source), str(folder)):
            shutil.rmtree(old, ignore_errors=True)
        return time.perf_counter() - t0

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, held: Held, step: int, prompt_id: int) -> torch.Tensor:
        """Prompt ``prompt_id``'s group at ``step`` with version ``held``: (G, max_new) token ids."""
        from concurrent.futures import ThreadPoolExecutor

        prompts, _ = make_prompts(self.task, self.vocab, self.spec.seed, [prompt_id])
        ids = prompts[0].tolist()
        g = self.spec.group_size
        with self._lock:
            if self._held.version != held.version or self._held.digest != held.digest:
                raise StaleVersion(f"now serving version {self._held.version}, not {held.version}")

            def one(j: int) -> list[int]:
                body = {"model": self.model_name, "prompt": ids, "max_tokens": self.max_new,
                        "temperature": self.spec.temperature, "top_p": 1.0, "n": 1,
                        "seed": sample_seed(self.spec.seed, step, prompt_id, j) & 0x7FFFFFFF,
                        "return_token_ids": True, "skip_special_tokens": False}
                choice = self._call("POST", "/v1/completions", body)["choices"][0]
                got = choice.get("token_ids")
                if not isinstance(got, list):
                    raise EngineFailed("vLLM returned no token_ids (needs a vLLM that knows return_token_ids).")
                return [int(x) for x in got][: self.max_new]

            with ThreadPoolExecutor(max_workers=g) as pool:
                rows = list(pool.map(one, range(g)))
        out = torch.full((g, self.max_new), self.vocab.pad, dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out
