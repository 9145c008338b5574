"""`forward` and `forward_backward` of several engines over one model, in shared passes.

The engines are LoRA adapters of the same base (a model host's training clients). Their datums are packed into
the same passes, each datum through its own adapter (engine/adapter_tokens.py), so the base's work is done once
per pass instead of once per client. Each loss is a token-level sum of its own datums, so one backward of the
sum gives each adapter exactly the gradient its own `forward_backward` would: no other adapter's loss depends
on its weights, and attention never crosses datums.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hanzo_gym.engine.adapter_tokens import TokenAdapters, takes_token_adapters
from hanzo_gym.engine.engine import Engine, ForwardBackwardOutput, check_datums, check_loss_inputs
from hanzo_gym.engine.losses import LOSS_FNS, OPTIONAL_INPUTS, REQUIRED_INPUTS
from hanzo_gym.errors import GymError
from hanzo_gym.records import Datum


@dataclass(eq=False)
class AdapterJob:
    engine: Engine
    datums: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict | None = None


def why_not_shared(engine: Engine) -> str | None:
    """None when this engine's calls can share passes with other adapters' engines; else why not."""
    if engine.adapter_name is None:
        return "it trains no adapter"
    if engine.routes_experts:
        return "its router's load-balancing loss covers the whole pass"
    if engine.loss_scaler is not None:
        return "it scales its loss (fp16)"
    return takes_token_adapters(engine.model, engine.adapter_name)


def score_together(jobs: list[AdapterJob], backward: bool) -> list[ForwardBackwardOutput]:
    """Each job's `Engine.forward_backward` (or with `backward=False` its `forward_loss`), all in shared passes;
    the outputs in the jobs' order. The engines must share one model, each with its own adapter. A failure
    leaves every adapter's gradients as they were (none of the jobs happened)."""
    parameters = [p for job in jobs for p in job.engine.trainable] if backward else []
    earlier = [p.grad for p in parameters]  # set aside: the passes accumulate into fresh gradients
    for parameter in parameters:
        parameter.grad = None
    try:
        outputs = _scored_together(jobs, backward)
    except BaseException:
        for parameter, grad in zip(parameters, earlier):
            parameter.grad = grad
        raise
    for parameter, grad in zip(parameters, earlier):
        if grad is not None:
            parameter.grad = grad if parameter.grad is None else grad.add_(parameter.grad)
    return outputs


def _scored_together(jobs: list[AdapterJob], backward: bool) -> list[ForwardBackwardOutput]:
    driver = jobs[0].engine
    if len({id(job.engine.model) for job in jobs}) > 1:
        raise GymError("score_together: the engines do not share one model")
    if len({job.engine.adapter_name for job in jobs}) < len(jobs):
        raise GymError("score_together: two jobs of one adapter (run them one after the other)")
    for job in jobs:
        if job.loss_fn not in LOSS_FNS:
            raise GymError(f"unknown loss_fn `{job.loss_fn}`; choose one of {', '.join(LOSS_FNS)}")
        reason = why_not_shared(job.engine)
        if reason:
            raise GymError(
                f"score_together: adapter `{job.engine.adapter_name}` cannot share a pass: {reason}"
            )
        check_datums(job.datums)
        check_loss_inputs(job.datums, job.loss_fn)
    owners = [k for k, job in enumerate(jobs) for _ in job.datums]
    datums = [datum for job in jobs for datum in job.datums]
    outputs = [ForwardBackwardOutput(0.0, [], {}, []) for _ in jobs]
    if backward:
        driver.model.train()
        scoring = contextlib.nullcontext()
    else:
        scoring = driver._scoring()
    names = [job.engine.adapter_name for job in jobs]
    with scoring, TokenAdapters(driver.model, names, trains=backward) as router:
        start = 0
        for group in driver._passes(datums):
            members = owners[start : start + len(group)]
            start += len(group)
            logprobs_N, values = driver._packed_logprobs(
                group, adapters=(router, [names[k] for k in members])
            )
            total = logprobs_N.new_zeros(())
            offset = 0
            for k in dict.fromkeys(members):  # a job's datums are consecutive within a pass
                mine = [d for d, owner in zip(group, members) if owner == k]
                length = sum(len(d) for d in mine)
                loss = _loss(driver, jobs[k], mine, logprobs_N[offset : offset + length])
                lengths = [len(d) for d in mine]
                outputs[k].loss_sum += loss.item()
                outputs[k].logprobs.extend(logprobs_N[offset : offset + length].detach().cpu().split(lengths))
                outputs[k].entropies.extend(values["entropy"][offset : offset + length].cpu().split(lengths))
                offset += length
                total = total + loss
            if backward:
                total.backward()
    for output in outputs:
        output.metrics = {"loss:sum": output.loss_sum}
    return outputs


def _loss(driver: Engine, job: AdapterJob, datums: list[Datum], logprobs_N: torch.Tensor) -> torch.Tensor:
    keys = [*REQUIRED_INPUTS[job.loss_fn], *(k for k in OPTIONAL_INPUTS if k in datums[0].loss_fn_inputs)]
    inputs = {key: driver._concat(datums, key, torch.float32) for key in keys}
    return LOSS_FNS[job.loss_fn](logprobs_N, inputs, job.loss_fn_config or {})
