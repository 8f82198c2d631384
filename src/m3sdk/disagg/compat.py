"""The compatibility record of a KV cache: what must match for a prefill node's pages to mean the same thing
on a decode engine. Compared field by field at handshake, so a mismatch names what differs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb
from m3sdk_kernels.layout import PAGE_SIZE

# 2: PrefillRequest.message_per_piece (a node of 1 would ignore it and send whole messages); 3: a group's pages are
# cut into messages evenly (wire.TransferPlan.build: a peer of 2 cuts them differently), token ids as 4-byte integers;
# 4: PrefillRequest.images (a node of 3 would ignore them and compute the image tokens' ids as text)
PROTOCOL_VERSION = 4


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CompatInfo:
    model_fingerprint: str  # digest of the checkpoint's config and weights (the loader computes it)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sparse_layers: tuple[int, ...]
    index_head_dim: int
    page_size: int
    kv_dtype: str
    index_dtype: str
    fp8_dtype: str
    model_dtype: str  # the compute dtype changes the values written, so it is part of compatibility
    layout: str

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_fingerprint: str) -> CompatInfo:
        return cls(model_fingerprint=model_fingerprint, num_layers=spec.num_layers,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   sparse_layers=tuple(spec.sparse_layers), index_head_dim=spec.index_head_dim,
                   page_size=PAGE_SIZE, kv_dtype=spec.kv_dtype, index_dtype=spec.index_dtype,
                   fp8_dtype=_dtype_name(spec.fp8_dtype) if spec.kv_dtype == "fp8" else "",
                   model_dtype=_dtype_name(spec.model_dtype), layout=spec.layout)

    @property
    def digest(self) -> str:
        """sha256 over the canonical JSON of every field (the cache size is deliberately not one)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def differences(self, other: CompatInfo) -> list[str]:
        """'field: ours != theirs' for each differing field; empty when compatible."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_proto(self) -> pb.CompatInfo:
        fields = dataclasses.asdict(self)
        fields["sparse_layers"] = list(self.sparse_layers)
        return pb.CompatInfo(**fields, compat_hash=self.digest)

    @classmethod
    def from_proto(cls, msg: pb.CompatInfo) -> CompatInfo:
        """The peer's record; its hash is recomputed, not trusted, so a lying peer still mismatches."""
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name != "sparse_layers"},
                   sparse_layers=tuple(msg.sparse_layers))


def model_fingerprint(path: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A digest of a checkpoint folder: config.json, and each weight file's name, size, first and last
    `sample_bytes` (hashing hundreds of GB whole at every start is not an option; retrained weights differ
    in both ends, where the headers and the first and last tensors sit)."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            h.update(f.read(sample_bytes))
            f.seek(max(0, size - sample_bytes))
            h.update(f.read(sample_bytes))
    return h.hexdigest()
