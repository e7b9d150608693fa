"""The lm-eval model `clo`: our decoder with any KV system, one request at a time. Its model args are Hydra
overrides over conf/ (experiments.accuracy.config), e.g. `--model clo --model_args system=clo,system.eta=0.7`.

Each request is prefilled densely (shared between systems through the backbone's cache), handed to a fresh system
planned for its length, then decoded by it: generate_until greedily until a stop string, the EOS token or
max_gen_toks (lm-eval's stop handling, as its `hf` backend does it); loglikelihood with the continuation's tokens as
decode steps through the system (workload.loglikelihood=decode) or one dense forward pass (prefill). What each
request cost is kept in `records`."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from omegaconf import DictConfig
from tqdm import tqdm

from experiments.accuracy.backbone import Backbone, backbone_for
from experiments.accuracy.config import check_workload, compose_config, override_text
from experiments.accuracy.decoding import greedy_until, teacher_forced
from experiments.runner import run_settings
from kvoffload.errors import ConfigError

log = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's


@register_model("clo")
class CLOLM(TemplateLM):
    """lm-eval's `batch_size`, `max_batch_size` and `device` are taken as it passes them (requests run one at a
    time whatever the batch size; `device` applies unless the model args set one); `tokenizer` (RULER's, read from
    the model args by its tasks) is left to them; `max_length` caps prompt + generation (default: the model's
    max_position_embeddings)."""

    def __init__(
        self,
        config: DictConfig | None = None,
        system_name: str | None = None,
        backbone: Backbone | None = None,
        batch_size: Any = None,
        max_batch_size: Any = None,
        device: str | None = None,
        max_length: int | None = None,
        tokenizer: str | None = None,
        trust_remote_code: Any = None,
        **overrides: Any,
    ):
        super().__init__()
        if config is None:
            args = [override_text(k, v) for k, v in overrides.items()]
            if device is not None and "device" not in overrides:
                if str(device).startswith("cuda") and not torch.cuda.is_available():
                    log.warning("lm-eval's device %s is not available here: device=auto", device)
                else:
                    args.append(f"device={device}")
            config, system_name = compose_config(args)
        elif overrides:
            raise ConfigError(f"CLOLM: give a config or overrides, not both ({sorted(overrides)})")
        check_workload(config)
        self.cfg, self.system_name = config, system_name or "?"
        self.backbone = backbone or backbone_for(config)
        self.tokenizer = self.backbone.tokenizer
        cap = self.backbone.model_cfg.max_position_embeddings
        self._max_length = run_settings.integer(max_length, "max_length", 2) if max_length is not None else cap
        if self._max_length > cap:
            raise ConfigError(f"max_length={self._max_length} exceeds the model's max_position_embeddings={cap}")
        self.decode_mode: str | None = None
        self.records: list[dict] = []
        self.system_state: dict | None = None  # the last request's system.describe(): its plan, for the record

    # ---- what lm-eval reads -----------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model": self.backbone.model_cfg.name, "weights": self.backbone.weights, "system": self.system_name}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the hf backend: the tokenizer's own special tokens unless told, none when the text starts with BOS."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ---- one request ------------------------------------------------------------------------------------------
    def _prefilled_system(self, ids: list[int], max_new: int):
        """(prefill, a system holding it, the record's prefill fields)."""
        pre, shared = self.backbone.prefill(ids)
        system = self.backbone.system(self.cfg.system, self.system_name, len(ids), max_new)
        if self.decode_mode is None:
            self.decode_mode = run_settings.resolve_decode_mode(self.cfg.decode_mode, self.device, system)
        # events cannot time phases inside a replayed graph
        system.timer.enabled = bool(self.cfg.get("profile_phases", True)) and self.decode_mode != "graph"
        self.system_state = system.describe()
        t0 = time.perf_counter()
        pre.load_into(system)
        fields = {
            "prompt_tokens": len(ids),
            "prefill_s": round(pre.seconds, 4),
            "prefill_shared": shared,
            "load_s": round(time.perf_counter() - t0, 4),
        }
        return pre, system, fields

    def _generate_one(self, context: str, gen_kwargs: dict) -> tuple[str, dict]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ConfigError("the clo model decodes greedily; this task asks for do_sample=true")
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        max_new = kwargs.pop("max_gen_toks")
        if max_new >= self.max_length:
            raise ConfigError(f"max_gen_toks={max_new} leaves no room for a prompt in max_length={self.max_length}")
        ids = self.tok_encode(context)[-(self.max_length - max_new) :]
        pre, system, fields = self._prefilled_system(ids, max_new)
        stops = [s for s in until if s]
        run = greedy_until(
            self.backbone.model,
            system,
            pre.logits,
            max_new,
            {self.eot_token_id},
            lambda toks: any(s in self.tok_decode(toks) for s in stops),
            self.decode_mode,
        )
        text = postprocess_generated_text(self.tok_decode(run.tokens), until, None)
        return text, {**fields, "new_tokens": len(run.tokens), **run.stats()}

    def _score_one(self, context: list[int], continuation: list[int]) -> tuple[tuple[float, bool], dict]:
        # as the hf backend: the window's last max_length + 1 tokens, the last one only predicted
        whole = (context + continuation)[-(self.max_length + 1) :]
        ctx = whole[: len(whole) - len(continuation)]
        if not ctx or len(continuation) > self.max_length:
            raise ConfigError(f"a continuation of {len(continuation)} tokens does not fit max_length={self.max_length}")
        if self.cfg.workload.get("loglikelihood", "decode") == "prefill":
            t0 = time.perf_counter()
            logits = self.backbone.all_logits(whole[:-1])[len(ctx) - 1 :]
            logp = torch.log_softmax(logits.float(), -1)
            target = torch.tensor(continuation, device=logp.device)
            answer = float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())
            return answer, {"prompt_tokens": len(whole) - 1, "prefill_s": round(time.perf_counter() - t0, 4)}
        pre, system, fields = self._prefilled_system(ctx, len(continuation))
        run = teacher_forced(self.backbone.model, system, pre.logits, continuation)
        return (run.logprob, run.greedy), {**fields, "new_tokens": len(continuation), **run.stats()}

    # ---- lm-eval's request types ------------------------------------------------------------------------------
    def _record(self, kind: str, req, fields: dict) -> None:
        where = {"task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None)} if req else {}
        self.records.append({"kind": kind, **where, **fields})

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, desc=f"generate_until ({self.system_name})", disable=disable_tqdm):
            context, gen_kwargs = req.args
            text, fields = self._generate_one(context, gen_kwargs)
            self._record("generate_until", req, fields)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._pending = list(requests)  # for the records: TemplateLM hands on token lists only
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._pending = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, reqs=None) -> list[tuple[float, bool]]:
        reqs = reqs or getattr(self, "_pending", None)
        out = []
        for i, (pair, context, continuation) in enumerate(
            tqdm(requests, desc=f"loglikelihood ({self.system_name})", disable=disable_tqdm)
        ):
            answer, fields = self._score_one(list(context), list(continuation))
            self._record("loglikelihood", reqs[i] if reqs else None, fields)
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text in disjoint windows of max_length tokens, each window scored after the one token before it
        (lm-eval's rolling windows, as the hf backend builds them)."""
        out = []
        for req in tqdm(requests, desc=f"loglikelihood_rolling ({self.system_name})", disable=disable_tqdm):
            (text,) = req.args
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            scored = [(None, *lm_utils.make_disjoint_window(w)) for w in windows]
            total = sum(lp for lp, _ in self._loglikelihood_tokens(scored, disable_tqdm=True, reqs=[req] * len(scored)))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out
