"""Device profiles: what the planner assumes about the hardware it plans for.

Built-in profiles come from the vendors' published figures, except `cpu`,
which was measured on this project's 2-core CI machines (one rank per core,
gloo over loopback; `bench/planner_validation.py --calibrate` re-measures it).
Sustained throughput is a fraction of the peak that well-tuned training
reaches (model FLOPs utilisation); it is the number to adjust first when
measured step times disagree. Any field can be overridden, and new profiles
added, with `planner.device_profiles` in `conf/<env>/parameters_planning.yml`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import AUTO
from meshtrain.planner.types import LayoutError, Refusal

GIB = 2**30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gib: float  # per device (per rank); for cpu, the host memory a rank may use
    devices_per_node: int
    tflops_fp32: float  # sustained, per device
    tflops_bf16: float
    intra_node_gbps: float  # GB/s per device for collectives inside a node
    inter_node_gbps: float  # GB/s per device across nodes
    latency_us: float  # per collective hop
    memory_gbps: float  # device memory bandwidth, for the optimizer's elementwise update
    # What a rank holds before any tensor of the model: the process's libraries and
    # interpreter on cpu (measured), the runtime's context and buffers on accelerators.
    runtime_gib: float = 0.0
    # What a caching allocator reserves from the device beyond the tensors it holds, as a
    # share of the step's peak of tensors (0: the process's own allocator, counted in
    # runtime_gib on cpu).
    allocator_share: float = 0.0
    # The share of compute time behind which sharded data parallelism's all-gathers and
    # reduce-scatters can run: 1 where copy engines and streams move the bytes while the
    # cores compute; 0 where the same cores do both (gloo on CPU).
    collective_overlap: float = 1.0
    # Where the rate depends on the matmul sizes (CPU cores: small matmuls leave the cores
    # waiting on memory and the framework), the fp32 rate measured per size class:
    # (width, tokens, TFLOP/s), width being a rank's matmul width (`cost.matmul_width`) and
    # tokens those of one forward (a microbatch); interpolated in log2 of both, held
    # beyond the points measured. Empty: `tflops_fp32` at every size. Measured on the
    # device's own path: the layers as torch runs them, no model converter.
    tflops_fp32_by_shape: tuple[tuple[float, float, float], ...] = ()
    # The same kind of table per model converter that changes the rate of the layers it
    # runs (`models/converters.py`), by the converter's name: a run through one is timed
    # on its table. A converter without one here: `tflops_fp32_by_shape`.
    converter_tflops_fp32_by_shape: dict[str, tuple[tuple[float, float, float], ...]] = field(
        default_factory=dict, hash=False
    )
    # The published dense peak per device (TFLOP/s), the base of the model FLOPs
    # utilisation (MFU) a run logs; 0: unknown, no MFU. fp32 is TF32 on the GPUs.
    peak_tflops_fp32: float = 0.0
    peak_tflops_bf16: float = 0.0
    # What one pipeline send/recv adds on the critical path, where it differs from a
    # collective's hop (0: `latency_us`): a point-to-point transfer waits for no third rank.
    p2p_latency_us: float = 0.0
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def runtime_bytes(self) -> int:
        return int(self.runtime_gib * GIB)

    def tflops(
        self,
        bf16: bool,
        width: float | None = None,
        tokens: float | None = None,
        *,
        converters: tuple[str, ...] = (),
    ) -> float:
        """The sustained rate; fp32 at a rank's matmul `width` and `tokens` per forward from
        the table of the first of the run's `converters` the profile measured, else from
        `tflops_fp32_by_shape`, where measured (converters change what the cores run)."""
        if bf16:
            return self.tflops_bf16
        tables = self.converter_tflops_fp32_by_shape
        table = next((tables[c] for c in converters if tables.get(c)), self.tflops_fp32_by_shape)
        if width is None or tokens is None or not table:
            return self.tflops_fp32
        by_width: dict[float, list[tuple[float, float]]] = {}
        for w, t, rate in table:
            by_width.setdefault(w, []).append((t, rate))
        at_tokens = [(w, _interpolate_log2(sorted(p), tokens)) for w, p in by_width.items()]
        return _interpolate_log2(sorted(at_tokens), width)

    @property
    def send_latency_us(self) -> float:
        """Microseconds of one pipeline send/recv beyond its bytes."""
        return self.p2p_latency_us or self.latency_us

    def peak_tflops(self, bf16: bool) -> float:
        """The published peak a run's MFU is measured against (0: unknown)."""
        return self.peak_tflops_bf16 if bf16 else self.peak_tflops_fp32

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _interpolate_log2(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear in log2(x) through `points` (sorted by x), constant beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


# The H100 SXM; the H200 is the same chip with more and faster memory.
_HOPPER = DeviceProfile(
    name="h100",
    memory_gib=80.0,
    devices_per_node=8,
    # 989 TFLOPs dense bf16, ~495 TF32 peak (SXM); 40% sustained.
    tflops_fp32=198.0,
    tflops_bf16=396.0,
    peak_tflops_fp32=494.7,
    peak_tflops_bf16=989.4,
    intra_node_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional
    inter_node_gbps=50.0,  # one 400 Gb/s InfiniBand NIC per GPU
    latency_us=10.0,
    memory_gbps=3350.0,
    # Measured on one H200 (torch 2.11, CUDA 13, 2026-12-04; bench/dryrun_cuda.py,
    # conf/gpu's 1.1B, bf16, 4 x 2,048 tokens): the device's use beyond the
    # allocator's reserved peak was 1,325 MiB (CUDA context, cuBLAS workspace,
    # libraries; one GPU, so no NCCL communicator), and the allocator reserved
    # 39,736 MiB for a peak of 38,406 MiB of tensors (3.5% more).
    runtime_gib=1.3,
    allocator_share=0.035,
    note="published H100 SXM figures, 40% of peak sustained",
)


BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        DeviceProfile(
            name="cpu",
            memory_gib=8.0,
            devices_per_node=2,
            # Effective rate of forward + backward on one core while the other trains too,
            # elementwise work and framework overhead included, per matmul width (hidden
            # size) and tokens per forward: small matmuls leave the core waiting on memory
            # and the framework (bench/planner_validation.py --calibrate; the default model
            # is width 128). The flat rate is the 128-wide one through the oneDNN converter.
            tflops_fp32=0.060,
            # The Linear layers on torch.mm (MKL on AVX2), as runs without the converter
            # (AVX2-only CPUs under `training.cpu_matmul: auto`, `blas`, tensor-parallel
            # layouts) run them: the converter's table below times the torch.mm / oneDNN
            # ratio --calibrate measured side by side (0.61-0.71 by shape; the machine's
            # own speed moves 20-40% between invocations, the ratio much less). An
            # AVX2-only EPYC ran MKL's GEMM at the same rate (2026-12-03, docs/speed.md).
            tflops_fp32_by_shape=(
                (128, 256, 0.031),
                (128, 1024, 0.038),
                (256, 256, 0.054),
                (256, 1024, 0.050),
                (512, 256, 0.071),
                (512, 1024, 0.072),
                (768, 512, 0.070),
                (768, 1024, 0.078),
            ),
            # With the Linear layers on oneDNN (`models/cpu_linear.py`), where
            # `training.cpu_matmul: auto` puts them on AVX-512 AMD cores (measured on
            # such a machine): the mean of two invocations.
            converter_tflops_fp32_by_shape={
                "onednn_linear": (
                    (128, 256, 0.048),
                    (128, 1024, 0.060),
                    (256, 256, 0.077),
                    (256, 1024, 0.074),
                    (512, 256, 0.107),
                    (512, 1024, 0.116),
                    (768, 512, 0.114),
                    (768, 1024, 0.127),
                ),
            },
            # No bf16 matmul units on these cores: autocast measured ~10x slower than fp32.
            tflops_bf16=0.003,
            # One core's fp32 GEMM rate, the faster library's (bench/machine_limit.py, 2x1:
            # oneDNN 160-187 GFLOP/s per thread, torch.mm 73-103); bf16 has no faster units
            # here, so the same rate is its ceiling.
            peak_tflops_fp32=0.18,
            peak_tflops_bf16=0.18,
            intra_node_gbps=0.8,
            inter_node_gbps=0.1,
            # gloo over loopback: a small 2-rank all-reduce takes 1-2.6 ms alone, but ~10 ms
            # inside a training step (each collective also waits for the other rank, which
            # shares the two cores): fitted to the tp2 runs of planner_validation.py.
            latency_us=5000.0,
            # gloo send/recv alone: 70-120 us one way (planner_validation.py --calibrate);
            # inside a 1F1B step the receiving stage waits 1-2 ms between its spans (the
            # schedule's picture of tiny pp2, 4 microbatches), the schedule's own work included.
            p2p_latency_us=1000.0,
            memory_gbps=8.0,
            # A worker after importing torch, transformers and mlflow and joining the gloo
            # group: 521 MiB resident (measured on the project's 2-core machine).
            runtime_gib=0.5,
            # bench/memory.py sharding: dp4 fully sharded ran at 0.68x ZeRO-1's
            # tokens/s on the 27M model, about its collectives' time added in full.
            collective_overlap=0.0,
            note="measured on the project's 2-core machines (gloo over loopback)",
        ),
        _HOPPER,
        dataclasses.replace(
            _HOPPER,
            name="h200",
            memory_gib=141.0 * 1e9 / GIB,
            memory_gbps=4800.0,
            note="published H200 SXM figures (H100 compute, 141 GB HBM3e), 40% sustained",
        ),
        DeviceProfile(
            name="trn1",
            memory_gib=16.0,  # per NeuronCore-v2; 32 per trn1.32xlarge (16 chips x 2)
            devices_per_node=32,
            # Per Trainium chip (two NeuronCore-v2): 190 TFLOPs bf16, 47.5 fp32 (AWS Neuron
            # docs, "Trainium Architecture"); per core half of each.
            tflops_fp32=9.5,
            tflops_bf16=38.0,
            peak_tflops_fp32=23.75,
            peak_tflops_bf16=95.0,
            intra_node_gbps=48.0,  # NeuronLink-v2, 768 GB/s per chip over 16 chips' rings
            inter_node_gbps=3.1,  # 800 Gb/s EFA per trn1.32xlarge over 32 cores
            latency_us=20.0,
            memory_gbps=410.0,  # 820 GB/s HBM per chip
            runtime_gib=1.0,  # the Neuron runtime\'s reservation (typical)
            note="published trn1.32xlarge figures per NeuronCore, 40% sustained",
        ),
        DeviceProfile(
            name="trn2",
            memory_gib=24.0,  # per logical NeuronCore (LNC=2): 96 GiB per chip / 4
            devices_per_node=64,
            # Per Trainium2 chip: 667 TFLOPs dense bf16, 181 fp32; 4 logical cores per chip.
            tflops_fp32=18.1,
            tflops_bf16=67.0,
            peak_tflops_fp32=45.25,
            peak_tflops_bf16=166.75,
            intra_node_gbps=64.0,  # NeuronLink-v3, 1 TB/s per chip
            inter_node_gbps=6.2,  # 3.2 Tb/s EFA per trn2.48xlarge over 64 logical cores
            latency_us=20.0,
            memory_gbps=725.0,  # 2.9 TB/s HBM per chip
            runtime_gib=1.0,  # the Neuron runtime's reservation (typical)
            note="published trn2.48xlarge figures per logical NeuronCore, 40% sustained",
        ),
    )
}


# What a new profile may leave out: without peaks, its runs log no MFU.
OPTIONAL_FIELDS = {
    "name",
    "note",
    "peak_tflops_fp32",
    "peak_tflops_bf16",
    "p2p_latency_us",
    "converter_tflops_fp32_by_shape",
}
# Keys of older releases, and what replaced them.
RENAMED_FIELDS = {
    "blas_tflops_fp32_by_shape": (
        "Put the Linear layers' torch.mm rates in `tflops_fp32_by_shape` (the device's own "
        "path) and the oneDNN ones in `converter_tflops_fp32_by_shape: {onednn_linear: "
        "[[width, tokens, TFLOP/s], ...]}` (docs/planner.md)."
    ),
}


class RenamedFieldError(ValueError):
    """A profile override uses a key of an earlier release."""

    def __init__(self, profile: str, key: str) -> None:
        self.parameter = f"planner.device_profiles.{profile}"
        self.key, self.fix = key, RENAMED_FIELDS[key]
        super().__init__(f"{self.parameter}.{key} is no longer read. {self.fix}")


def device_profile(name: str, overrides: dict[str, dict[str, Any]] | None = None) -> DeviceProfile:
    """The named profile with `overrides[name]` applied (which may also define a new one)."""
    overrides = overrides or {}
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    for profile_name, values in overrides.items():
        renamed = sorted(set(values) & set(RENAMED_FIELDS))
        if renamed:
            raise RenamedFieldError(profile_name, renamed[0])
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(
                f"planner.device_profiles.{profile_name}.{unknown[0]} is not a profile field; "
                f"known: {', '.join(sorted(fields - {'name'}))}."
            )
    overrides = {key: _tuples(key, values) for key, values in overrides.items()}
    if name in BUILTIN_PROFILES:
        return dataclasses.replace(BUILTIN_PROFILES[name], **overrides.get(name, {}))
    if name in overrides:
        missing = sorted(fields - OPTIONAL_FIELDS - set(overrides[name]))
        if missing:
            raise ValueError(
                f"planner.device_profiles.{name} defines a new device and needs every field; "
                f"missing: {', '.join(missing)}."
            )
        return DeviceProfile(name=name, **overrides[name])
    known = sorted(set(BUILTIN_PROFILES) | set(overrides))
    raise ValueError(
        f"planner.device={name!r} is not a known device; use one of {', '.join(known)}."
    )


def _tuples(profile: str, values: dict[str, Any]) -> dict[str, Any]:
    """YAML gives the rate tables as lists of [width, tokens, TFLOP/s] lists (the
    converters' as a mapping of converter name to such a list)."""
    found = dict(values)
    if found.get("tflops_fp32_by_shape") is not None:
        found["tflops_fp32_by_shape"] = _rows(found["tflops_fp32_by_shape"])
    by_converter = found.get("converter_tflops_fp32_by_shape")
    if by_converter is not None:
        if not isinstance(by_converter, dict):
            raise ValueError(
                f"planner.device_profiles.{profile}.converter_tflops_fp32_by_shape maps a "
                "converter's name to its [[width, tokens, TFLOP/s], ...] rows; got "
                f"{type(by_converter).__name__}."
            )
        found["converter_tflops_fp32_by_shape"] = {
            str(converter): _rows(rows) for converter, rows in by_converter.items()
        }
    return found


def _rows(table: Any) -> tuple[tuple[float, float, float], ...]:
    return tuple(tuple(map(float, row)) for row in table)


def resolve_device(name: str, overrides: dict[str, dict[str, Any]], cuda: bool) -> DeviceProfile:
    """`auto`: the visible GPU's profile (h100/h200 by name, else h100) or `cpu`."""
    if name == AUTO:
        if not cuda:
            name = "cpu"
        else:
            from meshtrain.device import device_name  # noqa: PLC0415 (torch: a GPU's name)

            gpu = device_name(0).lower()
            name = "h200" if "h200" in gpu else "h100"
    try:
        return device_profile(name, overrides)
    except RenamedFieldError as error:
        refusal = Refusal(
            error.parameter, error.key, "a key this release no longer reads", error.fix
        )
        raise LayoutError([refusal]) from None
    except ValueError as error:
        reason = str(error).rstrip(".")
        fix = "Or define it in planner.device_profiles (docs/planner.md)."
        raise LayoutError([Refusal("planner.device", name, reason, fix)]) from None
