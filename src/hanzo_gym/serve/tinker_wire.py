"""The Tinker SDK's wire formats, translated to and from hanzo-gym's records.

`forward_backward` requests and the results of `forward_backward` and `asample` travel as protobuf, with the
message classes the official SDK ships (`tinker.proto.tinker_public_pb2`, Apache-2.0): the server needs the
`tinker` package installed (`pip install tinker==0.38.0`). Everything else is JSON, read here into plain values.
Checkpoints are `tinker://<run>/weights/<name>` on the wire and `gym://…` in-process: the same layout, so the
two map by swapping the scheme.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hanzo_gym.errors import GymError
from hanzo_gym.records import Datum, ModelInput, SampledSequence, SamplingParams, TensorData
from hanzo_gym.serve.tinker_fields import WireError, integer, number, stop_sequences
from hanzo_gym.tinker.paths import SCHEME as GYM_SCHEME

TINKER_SCHEME = "tinker://"
MAX_PROTO_BODY = 256 * 1024 * 1024  # a decompressed forward_backward body may not be larger
EMPTY_TOPK_LOGPROB = -99999.0  # what the SDK reads as "no entry" in a top-k cell
# The most a sampling request may ask for, checked before anything is allocated: tokens per sample, top-k.
MAX_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20


def proto():
    """The SDK's generated protobuf module, or a GymError saying how to install it."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise GymError(
            "the Tinker API needs the official SDK's protobuf messages: pip install tinker==0.38.0"
        ) from None
    return tinker_public_pb2


# -- checkpoint paths -----------------------------------------------------------------------------------------
def to_gym_path(path: str) -> str:
    """A path a client sent (tinker://… or a plain folder) as the in-process clients take it."""
    if path.startswith(TINKER_SCHEME):
        return GYM_SCHEME + path[len(TINKER_SCHEME) :]
    if path.startswith(GYM_SCHEME):
        raise WireError(f"{path}: checkpoints on this server are tinker://<run>/weights/<name> paths")
    return path


def to_tinker_path(path: str) -> str:
    return TINKER_SCHEME + path[len(GYM_SCHEME) :] if path.startswith(GYM_SCHEME) else path


# -- forward_backward ---------------------------------------------------------------------------------------
@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool
    data: list[Datum]


def decode_forward_backward(body: bytes, content_encoding: str = "") -> ForwardBackwardCall:
    pb = proto()
    if content_encoding.strip().lower() == "zstd":
        body = _unzstd(body)
    elif content_encoding.strip().lower() not in ("", "identity"):
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported (send zstd or none)")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest message: {exc}") from None
    config: dict[str, float] = {}
    if message.loss_fn_config_v2:
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise WireError(
                    f"loss_fn_config[{key!r}] is text ({value.text!r}); this server takes numbers"
                )
            config[key] = float(value.number)
    else:
        config = {key: float(value) for key, value in message.loss_fn_config.items()}
    data = [_datum(pb, datum, index) for index, datum in enumerate(message.data)]
    return ForwardBackwardCall(
        model_id=message.model_id,
        seq_id=int(message.seq_id),
        loss_fn=message.loss_fn,
        loss_fn_config=config or None,
        forward_only=bool(message.forward_only),
        data=data,
    )


def _unzstd(body: bytes) -> bytes:
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_PROTO_BODY)
    except zstandard.ZstdError as exc:
        raise WireError(
            f"the zstd body does not decompress (or is over {MAX_PROTO_BODY} bytes): {exc}"
        ) from None


def _datum(pb: Any, message: Any, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in message.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                f"datum {index}: model_input holds a {kind} chunk; this server takes text tokens only"
            )
        tokens.extend(_array(chunk.encoded_text.tokens, "<i4", f"datum {index}: model_input").tolist())
    inputs = {
        name: _tensor(pb, tensor, f"datum {index}: loss_fn_inputs[{name!r}]", most=len(tokens))
        for name, tensor in message.loss_fn_inputs.items()
    }
    return Datum(ModelInput.from_ints(tokens), inputs)


_WIRE_DTYPES = {1: ("float32", "<f4"), 2: ("int64", "<i8"), 3: ("int64", "<i4")}  # FLOAT32, INT64, INT32


def _tensor(pb: Any, message: Any, what: str, most: int) -> TensorData:
    """The tensor, refused before any allocation when its shape holds more than `most` values (a loss input
    has one value per token of its datum, so a shape is never taken on the client's word)."""
    if message.dtype not in _WIRE_DTYPES:
        raise WireError(f"{what}: dtype {pb.DType.Name(message.dtype)} is not supported (float32 or int64)")
    dtype, numpy_dtype = _WIRE_DTYPES[message.dtype]
    shape = [int(s) for s in message.shape]
    if any(size < 0 for size in shape) or math.prod(shape) > most:
        raise WireError(
            f"{what}: shape {shape} does not fit its datum's {most} tokens (one value per token of model_input)"
        )
    if message.WhichOneof("encoding") == "sparse_csr":
        array = _dense_of_csr(message.sparse_csr, shape, numpy_dtype, what)
    else:
        array = _array(message.dense, numpy_dtype, what)
        if shape and math.prod(shape) != array.size:
            raise WireError(f"{what}: shape {shape} does not hold {array.size} values")
    if not shape:
        shape = [int(array.size)]
    return TensorData(
        array.astype(np.int64 if dtype == "int64" else np.float32).reshape(-1).tolist(), dtype, shape
    )


def _array(data: bytes, numpy_dtype: str, what: str) -> np.ndarray:
    if len(data) % np.dtype(numpy_dtype).itemsize:
        raise WireError(f"{what}: {len(data)} bytes are not whole {numpy_dtype} values")
    return np.frombuffer(data, dtype=numpy_dtype)


def _dense_of_csr(csr: Any, shape: list[int], numpy_dtype: str, what: str) -> np.ndarray:
    """A sparse CSR tensor made dense, its index arrays checked against its shape first."""
    values = _array(csr.values, numpy_dtype, what)
    crow, cols = _array(csr.crow_indices, "<i8", what), _array(csr.col_indices, "<i8", what)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(cols) != len(values):
        raise WireError(f"{what}: a sparse CSR tensor needs a 2-D shape and matching index arrays")
    steps = np.diff(crow)
    if (
        crow[0] != 0
        or crow[-1] != len(values)
        or (steps < 0).any()
        or ((cols < 0) | (cols >= shape[1])).any()
    ):
        raise WireError(f"{what}: the CSR row pointers or column indices do not fit shape {shape}")
    dense = np.zeros(shape, dtype=numpy_dtype)
    dense[np.repeat(np.arange(shape[0]), steps), cols] = values
    return dense


def encode_forward_backward_output(
    outputs: Sequence[dict[str, TensorData]], metrics: dict[str, float]
) -> bytes:
    """One ArrayRecord holding every datum's arrays, field by field (the layout the SDK's reader slices)."""
    pb = proto()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    if outputs:
        record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            float_field = outputs[0][name].dtype == "float32"
            numpy_dtype = "<f4" if float_field else "<i8"
            arrays = [np.asarray(output[name].data, dtype=numpy_dtype) for output in outputs]
            shape = outputs[0][name].shape or [arrays[0].size]
            offsets = np.zeros(len(arrays) + 1, dtype="<i8")
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            record.fields[name].CopyFrom(
                pb.BatchedTensor(
                    data=b"".join(a.tobytes() for a in arrays),
                    offsets=offsets.tobytes(),
                    dtype=pb.DTYPE_FLOAT32 if float_field else pb.DTYPE_INT64,
                    trailing_shape=list(shape[1:]),
                )
            )
    return message.SerializeToString()


# -- sampling -------------------------------------------------------------------------------------------------
def prompt_tokens(prompt: Any) -> list[int]:
    """`{"chunks": [{"type": "encoded_text", "tokens": [...]}, …]}` as one token list."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise WireError('prompt must be {"chunks": [{"type": "encoded_text", "tokens": [...]}]}')
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text" or not isinstance(chunk.get("tokens"), list):
            raise WireError(f"prompt holds a {kind} chunk; this server takes text tokens (encoded_text) only")
        tokens.extend(chunk["tokens"])
    return tokens


def sampling_params(body: Any) -> SamplingParams:
    if not isinstance(body, dict):
        raise WireError("sampling_params must be an object")
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise WireError(f"sampling_params has unknown fields {unknown}; it takes {sorted(known)}")
    defaults, where = SamplingParams(), "sampling_params."
    top_k = integer(body, "top_k", defaults.top_k, low=-1, high=MAX_TOP_K, where=where)
    if top_k == 0:
        raise WireError("`sampling_params.top_k` must be -1 (no limit) or at least 1, not 0")
    return SamplingParams(
        max_tokens=integer(body, "max_tokens", None, low=1, high=MAX_TOKENS, where=where),
        seed=integer(body, "seed", None, low=0, high=2**63 - 1, where=where),
        stop=stop_sequences(body.get("stop")),
        temperature=number(body, "temperature", defaults.temperature, low=0, high=100, where=where),
        top_k=top_k,
        top_p=number(body, "top_p", defaults.top_p, low=0, high=1, above=True, where=where),
    )


def encode_sample_response(
    sequences: Sequence[SampledSequence],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
) -> bytes:
    pb = proto()
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        values = [math.nan if value is None else value for value in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None:
        k = max((len(row) for row in topk_prompt_logprobs if row), default=0)
        ids = np.zeros((len(topk_prompt_logprobs), k), dtype="<i4")
        logprobs = np.full((len(topk_prompt_logprobs), k), EMPTY_TOPK_LOGPROB, dtype="<f4")
        for position, row in enumerate(topk_prompt_logprobs):
            for rank, (token, logprob) in enumerate(row or []):
                ids[position, rank], logprobs[position, rank] = token, logprob
        message.topk_prompt_logprobs.CopyFrom(
            pb.TopkLogprobs(
                token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(topk_prompt_logprobs)
            )
        )
    return message.SerializeToString()
