"""Export a predictor as a plain module: frozen samples + temperature, no bayesify.

``export_predictor(predictor, path, example_input)`` builds

    x [B, ...] → (probs [B, C], epistemic [B])

where ``probs = (1/M) Σ_m softmax(f_m(x) / T)`` is the mixture predictive of the
M members and ``epistemic = H(probs) − (1/M) Σ_m H(softmax(f_m(x) / T))`` is the
mutual information (BALD). The members' noise / weight samples are frozen into
buffers, so the exported graph holds only ATen ops and tensors: loading the
``.pt2`` needs ``torch.export.load`` only, the ``.onnx`` onnxruntime only.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bayesify.core.context import SamplingContext, expand_plan_rows
from bayesify.core.method import Method, logits_of, tile
from bayesify.errors import BayesifyError

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel
    from bayesify.predict.predictor import BasePredictor

EPS = 1e-12
FORMATS = ("pt2", "onnx")
#: name prefixes of ATen ops that draw random numbers (rand, randn_like, normal_, ...):
#: an exported predictor must contain none
RANDOM_OP_PREFIXES = ("rand", "bernoulli", "normal", "uniform", "multinomial", "dropout",
                      "native_dropout", "exponential", "poisson", "cauchy", "geometric")


class FrozenNoiseContext(SamplingContext):
    """A sampling context that serves per-member noise from fixed tables.

    The first forward (``recording``) fills ``tables[(layer_id, tail, uniform)]``
    with the ``[M, *tail]`` noise that :meth:`SamplingContext.draw` would give
    (same seed per layer); afterwards every draw is a row gather from a table.
    """

    def __init__(self, source: SamplingContext) -> None:
        super().__init__(source.components)
        self.__dict__.update({k: v for k, v in vars(source).items() if k != "plan"})
        self.tables: dict[tuple[int, tuple[int, ...], bool], torch.Tensor] = {}
        self.recording = True

    def draw(self, layer_id: int, rows: int, tail: tuple[int, ...], device: torch.device,
             *, uniform: bool = False) -> torch.Tensor:
        plan = self.plan
        if plan.member is None:
            raise BayesifyError("a frozen (exported) predictor draws noise per member only")
        key = (layer_id, tuple(int(t) for t in tail), bool(uniform))
        table = self.tables.get(key)
        if table is None:
            if not self.recording:
                raise BayesifyError(
                    f"layer {layer_id} asked for noise of shape {key[1]} that was not drawn "
                    "when the predictor was frozen; the noise shape depends on the input "
                    "size, so export with an example input of the size you will use"
                )
            members = torch.arange(plan.num_members, device=device)
            with self.use(members, deterministic=plan.deterministic, member=members,
                          num_members=plan.num_members, seed=plan.seed):
                table = super().draw(layer_id, plan.num_members, tail, device, uniform=uniform)
            self.tables[key] = table
        return table.index_select(0, expand_plan_rows(plan.member, rows, device))


class FrozenNoiseMembers(nn.Module):
    """``x [B, ...] → [M, B, C]``: one tiled forward of a copy with frozen noise tables.

    Row ``m·B + b`` is example ``b`` seen by member ``m`` (component
    ``member_components[m]``), exactly as ``Method.member_logits`` lays it out.
    """

    def __init__(self, model: nn.Module, context: FrozenNoiseContext,
                 member_components: torch.Tensor, *, seed: int, deterministic: bool) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "context", context)  # not a submodule
        self.register_buffer("member_components", member_components.clone())
        self.seed = int(seed)
        self.deterministic = bool(deterministic)
        self._table_names: dict[tuple[int, tuple[int, ...], bool], str] = {}

    def freeze_tables(self) -> None:
        """Move the recorded tables into buffers (so export stores them as tensors)."""
        for i, (key, table) in enumerate(sorted(self.context.tables.items())):
            name = f"noise_{key[0]}_{i}"
            self.register_buffer(name, table.detach().clone())
            self._table_names[key] = name
        self.context.recording = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, b = self.member_components.shape[0], x.shape[0]
        member = torch.arange(m, device=x.device).unsqueeze(1).expand(m, b).reshape(-1)
        component = self.member_components.unsqueeze(1).expand(m, b).reshape(-1)
        if not self.context.recording:
            # read the buffers inside forward so tracing sees them as module state
            self.context.tables = {k: getattr(self, n) for k, n in self._table_names.items()}
        with self.context.use(component, deterministic=self.deterministic, member=member,
                              num_members=m, seed=self.seed):
            logits = logits_of(self.model(tile(x, m)))
        return logits.reshape(m, b, logits.shape[-1])


def frozen_noise_members(bnn: BayesianModel, *, samples_per_component: int, seed: int,
                         example_input: torch.Tensor) -> FrozenNoiseMembers:
    """Default :meth:`Method.export_module`: a frozen-noise copy of ``bnn.model``.

    Valid for families that predict with the default ``Method.member_logits``
    and whose layers draw noise only through ``SamplingContext.draw``.
    """
    method = bnn.method
    if type(method).member_logits is not Method.member_logits:
        raise BayesifyError(
            f"method {method.name!r} cannot be exported: it overrides member_logits, so its "
            "prediction is not M noise-frozen copies of the network; the family has to "
            "implement Method.export_module"
        )
    model = copy.deepcopy(bnn.model).eval()
    context = FrozenNoiseContext(bnn.context)
    for module in model.modules():
        if isinstance(module.__dict__.get("context"), SamplingContext):
            object.__setattr__(module, "context", context)
    members = method.member_components(samples_per_component, example_input.device)
    frozen = FrozenNoiseMembers(model, context, members, seed=seed,
                                deterministic=bnn.context.force_deterministic)
    with torch.no_grad():
        frozen(example_input)  # records every layer's [M, ...] noise table
    frozen.freeze_tables()
    return frozen


class StackedModels(nn.Module):
    """Plain networks (MAP or a deep ensemble) as ``x → [M, B, C]``."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(copy.deepcopy(m).eval() for m in models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([logits_of(m(x)).float() for m in self.models])


class ExportedPredictor(nn.Module):
    """``x → (probs [B, C], epistemic [B])`` from member logits and a temperature.

    Same arithmetic as :class:`~bayesify.predict.prediction.Prediction`:
    ``log p = logsumexp_m log_softmax(f_m / T) − log M``; MI = H(p) − mean_m H(p_m) ≥ 0.
    """

    def __init__(self, members: nn.Module, temperature: float, num_members: int) -> None:
        super().__init__()
        self.members = members
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.num_members = int(num_members)
        self.log_members = math.log(num_members)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.members(x).float() / self.temperature
        member_log_probs = logits.log_softmax(-1)
        probs = (torch.logsumexp(member_log_probs, dim=0) - self.log_members).exp()
        member_probs = member_log_probs.exp()
        total = -(probs * probs.clamp_min(EPS).log()).sum(-1)
        aleatoric = -(member_probs * member_probs.clamp_min(EPS).log()).sum(-1).mean(0)
        return probs, (total - aleatoric).clamp_min(0)


def build_exported_predictor(predictor: BasePredictor, example_input: torch.Tensor) -> ExportedPredictor:
    """The plain module behind :func:`export_predictor` (eval mode, on the input's device)."""
    from bayesify.predict.predictor import EnsemblePredictor, ModelPredictor

    x = example_input.to(predictor.device)
    if isinstance(predictor, EnsemblePredictor):
        bnn = predictor.bnn
        was_training = bnn.training
        bnn.eval()
        try:
            members = bnn.method.export_module(
                bnn, samples_per_component=predictor.samples_per_component,
                seed=predictor.seed, example_input=x,
            )
        finally:
            bnn.train(was_training)
    elif isinstance(predictor, ModelPredictor):
        members = StackedModels(predictor.models)
    else:
        raise BayesifyError(f"cannot export a {type(predictor).__name__}; use an "
                            "EnsemblePredictor (bnn.predictor()) or a ModelPredictor")
    with torch.no_grad():
        num_members = members(x).shape[0]
    return ExportedPredictor(members, predictor.temperature, num_members).eval()


def _example(example_input: torch.Tensor) -> torch.Tensor:
    # torch.export specialises batch sizes 0/1: trace with at least two rows
    if example_input.shape[0] >= 2:
        return example_input
    return example_input[:1].expand(2, *example_input.shape[1:]).contiguous()


def _random_ops(program: torch.export.ExportedProgram) -> list[str]:
    found = []
    for node in program.graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            if name.startswith(RANDOM_OP_PREFIXES):
                found.append(str(node.target))
    return found


def export_program(module: ExportedPredictor, example_input: torch.Tensor,
                   *, method: str = "model") -> torch.export.ExportedProgram:
    """``torch.export`` with a dynamic batch axis; refuses graphs that draw random numbers."""
    x = _example(example_input)
    batch = torch.export.Dim("batch", min=1)
    try:
        with torch.no_grad():
            program = torch.export.export(module, (x,), dynamic_shapes={"x": {0: batch}},
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
    random_ops = _random_ops(program)
    if random_ops:
        raise BayesifyError(
            f"method {method!r} cannot be exported: its exported graph still draws random "
            f"numbers ({sorted(set(random_ops))}), i.e. some layer samples outside "
            "SamplingContext.draw; the family has to implement Method.export_module"
        )
    return program


def export_predictor(
    predictor: BasePredictor,
    path: str | Path,
    example_input: torch.Tensor,
    *,
    format: str = "pt2",
    verify: bool = True,
    atol: float = 1e-5,
) -> dict[str, Any]:
    """Freeze ``predictor`` (samples + temperature) and save it as ``.pt2`` or ONNX.

    ``example_input [B, ...]`` fixes every non-batch dimension; the batch axis
    stays dynamic. With ``verify`` the saved artefact is reloaded and its probs /
    epistemic must match the in-process predictor to ``atol`` on the example.
    Returns ``{"path", "format", "members", "temperature", "max_abs_diff"}``.
    """
    if format not in FORMATS:
        raise BayesifyError(f"unknown export format {format!r}; use one of {FORMATS}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    method = getattr(getattr(predictor, "bnn", None), "method_name", "model")
    module = build_exported_predictor(predictor, example_input)
    x = _example(example_input.to(predictor.device))
    program = export_program(module, x, method=method)
    # write beside the target and rename only once verified: no wrong file is left behind
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        if format == "pt2":
            torch.export.save(program, str(tmp))
        else:
            _save_onnx(program, tmp)
        diff = _verify(predictor, tmp, x, method=method, atol=atol) if verify else None
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(path), "format": format, "method": method,
            "members": module.num_members, "temperature": float(predictor.temperature),
            "max_abs_diff": diff}


def _verify(predictor: BasePredictor, path: Path, x: torch.Tensor, *, method: str,
            atol: float) -> float:
    """Max |difference| of probs / epistemic between the saved file and ``predictor``."""
    reference = predictor(x)
    probs, epistemic = run_exported(path, x)
    diff = max((probs.cpu() - reference.probs.cpu()).abs().max().item(),
               (epistemic.cpu() - reference.epistemic.cpu()).abs().max().item())
    if not diff <= atol:
        raise BayesifyError(
            f"the exported {method!r} predictor disagrees with the in-process one by "
            f"{diff:.3g} > {atol:g} on the example input; its layers keep state the "
            "export cannot capture, so the family has to implement Method.export_module"
        )
    return diff


def _save_onnx(program: torch.export.ExportedProgram, path: Path) -> None:
    try:
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False, input_names=["input"],
                                         output_names=["probs", "epistemic"])
    except ImportError as err:
        raise BayesifyError(
            "ONNX export needs onnx and onnxscript: pip install 'bayesify[export]'"
        ) from err
    onnx_program.save(str(path))


def run_exported(path: str | Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, epistemic)`` of a saved ``.pt2`` (torch, on ``x``'s device) or ``.onnx``
    (onnxruntime, CPU)."""
    path = Path(path)
    if path.suffix == ".onnx":
        try:
            import onnxruntime
        except ImportError as err:
            raise BayesifyError("running an ONNX export needs onnxruntime: "
                                "pip install 'bayesify[export]'") from err
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        probs, epistemic = session.run(None, {name: x.detach().cpu().float().numpy()})
        return torch.from_numpy(probs), torch.from_numpy(epistemic)
    module = torch.export.load(str(path)).module()
    with torch.no_grad():
        probs, epistemic = module(x.detach())
    return probs, epistemic
