"""Export a predictor as a plain module: frozen samples + temperature, no bayesify.

``export_predictor(predictor, path, example)`` builds

    inputs → (probs [B, C], epistemic [B])

where ``inputs`` are the example's inputs under the same names: one tensor
``x [B, ...]``, a tuple ``(input_0, input_1, ...)`` or a mapping such as
``{"input_ids" [B, N], "attention_mask" [B, N]}`` (see
:mod:`bayesify.predict.export_inputs`). The batch axis, and the sequence axis of
integer token inputs, stay dynamic.

where ``probs = softmax(log p̄ / T)`` is the predictive at the predictive-level temperature
(``log p̄ = logsumexp_m log_softmax(f_m(x)) − log M`` for M members, the link's output for a
Gaussian) and ``epistemic`` is the untempered mutual information (BALD) rescaled by
``H(probs) / H(p̄)`` (:func:`bayesify.core.prediction.decomposition`). The members' noise /
weight samples are frozen into
buffers, so the exported graph holds only ATen ops and tensors: loading the
``.pt2`` needs ``torch.export.load`` only, the ``.onnx`` onnxruntime only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.batch import Batch
from bayesify.errors import BayesifyError
from bayesify.kit.frozen_noise import (  # noqa: F401 - re-exported
    FrozenNoiseContext,
    FrozenNoiseMembers,
    frozen_noise_members,
)
from bayesify.kit.stacked import StackedModels  # noqa: F401 - re-exported
from bayesify.predict.export_inputs import (
    InputLayout,
    dynamic_shapes,
    example_batch,
    named_input_module,
    widen_example,
)

if TYPE_CHECKING:
    from bayesify.predict.predictor import BasePredictor

from bayesify.predict.export_meta import (
    export_metadata,
    export_method,
    metadata_text,
    onnx_bytes,
    pt2_bytes,
)
from bayesify.predict.export_trust import commit_export, sha256_of
from bayesify.predict.exported import (  # noqa: F401 - re-exported
    FORMATS,
    ExportedOutput,
    LoadedExport,
    format_of,
    load_exported,
    run_exported,
)
from bayesify.progress import is_rank_zero

logger = logging.getLogger(__name__)

EPS = 1e-12
#: name prefixes of ATen ops that always draw random numbers (rand, randn_like,
#: normal_, ...): an exported predictor must contain none
RANDOM_OP_PREFIXES = ("rand", "bernoulli", "normal", "uniform", "multinomial", "exponential",
                      "poisson", "cauchy", "geometric", "log_normal")
#: dropout ops ``op(input, p, train)``: they draw only when ``train`` is true and p > 0
#: (an eval-mode ``nn.Dropout`` traces as ``aten.dropout(x, p, False)``, the identity)
DROPOUT_OPS = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout",
               "feature_alpha_dropout")


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def _tempered_outputs(log_probs: torch.Tensor, aleatoric: torch.Tensor,
                      temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, epistemic)`` from the untempered ``log p̄ [B, C]`` and the untempered
    aleatoric part ``[B]``: the graph form of :class:`~bayesify.core.prediction.Prediction`'s
    ``probs`` and ``epistemic`` at ``temperature`` (``temper`` and ``decomposition``)."""
    probs = torch.softmax(log_probs / temperature, dim=-1)
    raw_total = _entropy(log_probs.exp())
    total = _entropy(probs)
    mi = torch.minimum((raw_total - aleatoric).clamp_min(0), raw_total)
    ratio = torch.where(raw_total > 0, total / raw_total.clamp_min(1e-30),
                        torch.zeros_like(raw_total))
    return probs, mi * ratio


class ExportedPredictor(nn.Module):
    """``inputs → (probs [B, C], epistemic [B])`` from member logits and a temperature.

    Same arithmetic as :class:`~bayesify.core.prediction.Prediction`:
    ``log p̄ = logsumexp_m log_softmax(f_m) − log M``, ``probs = softmax(log p̄ / T)``;
    epistemic = MI · H(probs) / H(p̄) ≥ 0.
    """

    def __init__(self, members: nn.Module, temperature: float, num_members: int) -> None:
        super().__init__()
        self.members = members
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.num_members = int(num_members)
        self.log_members = math.log(num_members)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        member_log_probs = self.members(*args, **kwargs).float().log_softmax(-1)
        log_probs = torch.logsumexp(member_log_probs, dim=0) - self.log_members
        aleatoric = _entropy(member_log_probs.exp()).mean(0)
        return _tempered_outputs(log_probs, aleatoric, self.temperature)


class GaussianExportedPredictor(nn.Module):
    """``inputs → (probs [B, C], epistemic [B])`` of a Gaussian predictive over the logits.

    ``moments(inputs) → [3, B, C]`` = (mean, diag Σ_f, Σ_f 1). Same arithmetic as
    :class:`~bayesify.core.prediction.Prediction`: the link gives ``log p̄`` (probit or
    bridge), the temperature acts on it (``softmax(log p̄ / T)``), and the aleatoric part
    is the expected entropy over the same fixed draws ``z [S, 1, C]`` (a buffer).
    """

    def __init__(self, moments: nn.Module, temperature: float, link: str, num_classes: int) -> None:
        super().__init__()
        from bayesify.core.prediction import gaussian_noise

        self.moments, self.link = moments, link
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.register_buffer("noise", gaussian_noise(num_classes))

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from bayesify.core.prediction import gaussian_expected_entropy, gaussian_log_probs

        mean, var, rowsum = self.moments(*args, **kwargs).float().unbind(0)
        log_probs = gaussian_log_probs(mean, var, self.link, rowsum=rowsum,
                                       total=rowsum.sum(-1))
        aleatoric = gaussian_expected_entropy(mean[None], var[None], self.noise)
        return _tempered_outputs(log_probs, aleatoric, self.temperature)


class GaussianMembersExportedPredictor(nn.Module):
    """``inputs → (probs [B, C], epistemic [B])`` of a mixture of Gaussians over the logits
    (member-wise Laplace heads): ``members(inputs) → [2, M, B, C]`` = (means, diag Σ_f). Same
    arithmetic as in process: ``log p̄`` the mixture of the members' probits, the aleatoric
    part the expected entropy over the fixed draws ``z [S, 1, C]`` of every member
    (:func:`~bayesify.core.prediction.gaussian_expected_entropy`; one member at a time)."""

    def __init__(self, members: nn.Module, temperature: float, num_members: int,
                 num_classes: int) -> None:
        super().__init__()
        from bayesify.core.prediction import gaussian_noise

        self.members = members
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.register_buffer("noise", gaussian_noise(num_classes))
        self.num_members = int(num_members)
        self.log_members = math.log(num_members)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from bayesify.core.prediction import gaussian_expected_entropy, gaussian_log_probs

        mean, var = self.members(*args, **kwargs).float().unbind(0)  # [M, B, C] each
        member_log_probs = gaussian_log_probs(mean, var, self.members.gaussian_members)
        log_probs = torch.logsumexp(member_log_probs, dim=0) - self.log_members
        return _tempered_outputs(log_probs, gaussian_expected_entropy(mean, var, self.noise),
                                 self.temperature)


def build_exported_predictor(predictor: BasePredictor, example_input: Any) -> nn.Module:
    """The plain module behind :func:`export_predictor` (eval mode, on the predictor's device).

    ``example_input``: a tensor, a tuple of inputs or a mapping (see
    :func:`~bayesify.predict.export_inputs.example_batch`); the module is called
    with the same inputs: ``module(x)``, ``module(*inputs)`` or ``module(**inputs)``.
    """
    example = example_batch(example_input).to(predictor.device)
    members = predictor.export_members(example)
    with torch.no_grad():
        out = example.call(members)
    link = getattr(members, "gaussian_link", None)
    if link is not None:
        return GaussianExportedPredictor(members, predictor.temperature, link,
                                         out.shape[-1]).eval()
    if getattr(members, "gaussian_members", None) is not None:
        return GaussianMembersExportedPredictor(members, predictor.temperature, out.shape[1],
                                                out.shape[-1]).eval()
    return ExportedPredictor(members, predictor.temperature, out.shape[0]).eval()


def _draws(node: torch.fx.Node) -> bool:
    """Whether an ATen call really draws random numbers (see ``DROPOUT_OPS``)."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in DROPOUT_OPS:
        args = list(node.args) + [None] * 3
        p = node.kwargs.get("p", args[1])
        train = node.kwargs.get("train", args[2])
        # native_dropout's train may be None ("use the default": training)
        return (train is None or bool(train)) and not (isinstance(p, (int, float)) and p == 0)
    return name.startswith(RANDOM_OP_PREFIXES)


def random_ops(program: torch.export.ExportedProgram) -> list[str]:
    """ATen calls of ``program`` (nested graphs included) that draw random numbers."""
    found = []
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        found += [str(n.target) for n in graph.nodes if n.op == "call_function" and _draws(n)]
    return found


class EvalBatchNormAsAffine(torch.overrides.TorchFunctionMode):
    """Within the mode, an eval-mode ``F.batch_norm`` (running statistics, ``training=False``)
    is computed as ``x · s + t`` with ``s = γ / √(σ² + ε)``, ``t = β − μ·s`` per channel.

    The same function of ``x``; torch.export on CUDA needs it: ATen's batch_norm chooses its
    cuDNN kernel by ``batch ≤ 65535``-style size checks, which a dynamic batch axis turns
    into guards the export refuses (``Expected op to be '==', got <= for batch <= …``),
    cuDNN switched off or not."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.batch_norm:
            names = ("input", "running_mean", "running_var", "weight", "bias", "training",
                     "momentum", "eps")
            bound = dict(zip(names, args), **kwargs)
            mean, var = bound.get("running_mean"), bound.get("running_var")
            if not bound.get("training", False) and mean is not None and var is not None:
                x = bound["input"]
                scale = torch.rsqrt(var + bound.get("eps", 1e-5))
                if bound.get("weight") is not None:
                    scale = scale * bound["weight"]
                shift = -mean * scale
                if bound.get("bias") is not None:
                    shift = shift + bound["bias"]
                shape = [1, -1] + [1] * (x.dim() - 2)
                return x * scale.to(x.dtype).view(shape) + shift.to(x.dtype).view(shape)
        return func(*args, **kwargs)


def export_program(module: nn.Module, example_input: Any, *, method: str = "model",
                   batchnorm_as_affine: bool | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` with dynamic batch (and token) axes; refuses graphs that draw
    random numbers. The program takes the example's inputs under their names.

    ``batchnorm_as_affine`` (default: when the example is on CUDA) traces eval-mode
    BatchNorm as a per-channel affine map (:class:`EvalBatchNormAsAffine`)."""
    example = widen_example(example_batch(example_input))
    layout = InputLayout.of(example)
    named = named_input_module(module, layout)
    if batchnorm_as_affine is None:
        batchnorm_as_affine = any(t.is_cuda for t in layout.tensors(example))
    try:
        with torch.no_grad():
            args, kwargs = layout.call_inputs(example)
            with EvalBatchNormAsAffine() if batchnorm_as_affine else contextlib.nullcontext():
                program = torch.export.export(named, args, kwargs=kwargs,
                                              dynamic_shapes=dynamic_shapes(layout, example),
                                              strict=False)
    except BayesifyError:
        raise
    except Exception as err:  # torch raises many kinds: name the family instead
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BayesifyError(
            f"method {method!r} cannot be exported: torch.export could not trace its "
            f"prediction ({type(err).__name__}: {first}); its layers use Python-side state "
            "or data-dependent shapes, so the family has to implement Method.export_module"
        ) from err
    _warn_fixed_token_axes(program, layout, example)
    drawn = random_ops(program)
    if drawn:
        raise BayesifyError(
            f"method {method!r} cannot be exported: its exported graph still draws random "
            f"numbers ({sorted(set(drawn))}), i.e. some layer samples outside "
            "SamplingContext.draw (or a Dropout is in training mode); the family has to "
            "implement Method.export_module"
        )
    return program


def _warn_fixed_token_axes(program: torch.export.ExportedProgram, layout: InputLayout,
                           example: Batch) -> None:
    """Token axes are traced with ``Dim.AUTO``: say so when the model fixed them."""
    wanted = {n: sorted(spec) for n, spec in dynamic_shapes(layout, example).items()}
    got = dynamic_axes(program)
    fixed = [n for n, axes in wanted.items() if 1 in axes and 1 not in got.get(n, [1])]
    if fixed:
        warnings.warn(
            f"the exported program fixes the sequence length of {fixed} to the example's "
            f"({[int(layout.tensors(example)[layout.names.index(n)].shape[1]) for n in fixed]}): "
            "the model specialises it (torch.export unrolls nn.LSTM / nn.GRU over time, for "
            "one); pad inputs to that length, or export once per length",
            stacklevel=3,
        )


def dynamic_axes(program: torch.export.ExportedProgram) -> dict[str, list[int]]:
    """Input name → axes the program left symbolic (batch, and tokens where it could)."""
    out: dict[str, list[int]] = {}
    specs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in specs:
        node = nodes.get(spec.arg.name)
        value = None if node is None else node.meta.get("val")
        if isinstance(value, torch.Tensor):
            # a SymInt that export replaced by a constant prints as a number
            out[spec.arg.name] = [i for i, d in enumerate(value.shape)
                                  if not isinstance(d, int) and not str(d).isdigit()]
    return out


def export_predictor(
    predictor: BasePredictor,
    path: str | Path,
    example_input: Any,
    *,
    format: str | None = None,
    verify: bool = True,
    atol: float = 1e-5,
    class_names: Any = None,
    preprocessing: Any = "auto",
) -> dict[str, Any]:
    """Freeze ``predictor`` (samples + temperature) and save it as ``.pt2`` or ONNX.

    The format follows the file name (``.pt2`` → ``torch.export``, ``.onnx`` → ONNX);
    ``format=`` may only repeat it. ``example_input``: a tensor ``[B, ...]``, a tuple
    of input tensors or a mapping (``{"input_ids" [B, N], "attention_mask" [B, N]}``; a
    ``labels`` entry is dropped). It fixes every non-dynamic dimension; the batch axis,
    and the token axis of integer ``[B, N]`` inputs, stay dynamic. The saved program
    takes the same inputs under the same names (``x`` for a single tensor, ``input_i``
    for a tuple, the keys of a mapping).

    The file carries its metadata (:mod:`bayesify.predict.export_meta`: class names —
    ``class_names=`` or a Hugging Face ``id2label`` —, ``preprocessing`` — ``"auto"``
    takes a timm model's own, or pass a torchvision transform / a description —, the
    family, the posterior fingerprint), repeated in ``FILE.json``; ``FILE.sha256`` is
    its integrity record, checked by :func:`run_exported`. With ``verify`` the file's
    bytes are read back through the same checks and its probs / epistemic must match
    the in-process predictor to ``atol`` on the example. Only then are the three files
    written, as one commit (:func:`~bayesify.predict.export_trust.commit_export`): a
    failure at any point leaves the previous export whole. Returns ``{"path", "format",
    "method", "members", "temperature", "max_abs_diff", "inputs", "dynamic_axes",
    "sha256", "files", "metadata"}``.
    """
    fmt = format_of(path, format)
    path = Path(path)
    method = export_method(predictor, "model")
    start, loud = time.perf_counter(), is_rank_zero()
    if loud:
        logger.info("export: %s predictor to %s (%s) ...", method, path, fmt)
    example = widen_example(example_batch(example_input).to(predictor.device))
    module = build_exported_predictor(predictor, example)
    program = export_program(module, example, method=method)
    names = list(InputLayout.of(example).names)
    with torch.no_grad():
        num_classes = int(example.call(module)[0].shape[-1])
    metadata = export_metadata(predictor, fmt=fmt, members=getattr(module, "num_members", 1),
                               num_classes=num_classes, inputs=names,
                               dynamic_axes=dynamic_axes(program), class_names=class_names,
                               preprocessing=preprocessing)
    path.parent.mkdir(parents=True, exist_ok=True)
    # built and verified in memory; then the program, FILE.json and FILE.sha256 commit as one
    if fmt == "pt2":
        data = pt2_bytes(program, metadata)
    else:
        data = onnx_bytes(_onnx_model(program, tuple(names)), metadata)
    digest = sha256_of(data)
    diff = _verify(predictor, path, data, example, method=method, atol=atol) if verify else None
    # FILE.json also records the program's size: a reader refuses a file of another size
    # before hashing it (a 64 GiB sparse file is refused at once)
    files = commit_export(path, data, metadata_text({**metadata, "program_bytes": len(data)}))
    if class_names is not None:  # remembered for this predictor's next export
        predictor.class_names = list(metadata["class_names"])
    if loud:
        logger.info("export: wrote %s in %.1f s (%s)", path, time.perf_counter() - start,
                    "verified" if diff is not None else "not verified")
    return {"path": str(path), "format": fmt, "method": method,
            "members": metadata["members"], "temperature": float(predictor.temperature),
            "max_abs_diff": diff, "inputs": names, "dynamic_axes": metadata["dynamic_axes"],
            "sha256": digest, "files": [str(f) for f in files], "metadata": metadata}


def _verify(predictor: BasePredictor, path: Path, data: bytes, example: Batch, *, method: str,
            atol: float) -> float:
    """Max |difference| of probs / epistemic between the file's bytes and ``predictor``
    (read back through :class:`LoadedExport`'s archive and metadata checks)."""
    reference = example.call(predictor)
    probs, epistemic = example.call(LoadedExport(path, data=data))
    diff = max((probs.cpu() - reference.probs.cpu()).abs().max().item(),
               (epistemic.cpu() - reference.epistemic.cpu()).abs().max().item())
    if not diff <= atol:
        raise BayesifyError(
            f"the exported {method!r} predictor disagrees with the in-process one by "
            f"{diff:.3g} > {atol:g} on the example input; its layers keep state the "
            "export cannot capture, so the family has to implement Method.export_module"
        )
    return diff


def _onnx_model(program: torch.export.ExportedProgram, names: tuple[str, ...]) -> Any:
    """The ONNX ``ModelProto`` of ``program`` (weights included), built in memory."""
    try:
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False,
                                         input_names=list(names),
                                         output_names=["probs", "epistemic"])
    except ImportError as err:
        raise BayesifyError(
            "ONNX export needs onnx and onnxscript: pip install 'bayesify[export]'"
        ) from err
    return onnx_program.model_proto
