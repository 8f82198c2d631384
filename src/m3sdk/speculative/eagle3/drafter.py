"""Eagle3Drafter: serves an Eagle3Head as a ChainDrafter, with fused weights, its own draft KV pool
(draft_cache.py) and CUDA graphs of its fixed-shape steps (the eager steps run the same step functions)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from m3sdk.graphs import Replay, batch_buckets
from m3sdk.speculative.base import DeviceDrafts
from m3sdk.speculative.chain import ChainDrafter, DraftSeq
from m3sdk.speculative.eagle3.draft_cache import DraftKV, DraftKVPool
from m3sdk.speculative.eagle3.head import Eagle3Head
from m3sdk.speculative.eagle3.read_inputs import ReadInts
from m3sdk.staging import UploadRing, to_device

# the drafter keeps the draft vocabulary's normed embeddings as a table up to this size (m3-tiny's head: 0.5 MiB)
DRAFT_EMBED_TABLE_BYTES = 64 << 20


class Eagle3Drafter(ChainDrafter):
    """Drafts a chain of k tokens per request, greedily (the verifier treats each as a point mass). The first
    entry of each observed position reads fc(aux states); chain entries read the head's pre-norm output.

    The draft KV cache is one pool [slots + 1, Hkv, capacity, D] (a row per request, the last row scratch for
    padding), so a draft step attends for every request in one batched op, and the read of a verify step's
    entries with the k - 1 chain steps after it is one fixed-shape function that `capture_graphs` records as a
    CUDA graph per batch bucket.

    On a GPU each op of a draft step is a kernel of a few microseconds whatever its size, so the step is written
    for few ops: the head's weights are fused once for inference (`_fuse`), a read computes its outputs only at
    each context's last entry (the other entries only need their keys and values in the cache), and the chain
    attends over float32 working copies of the contexts' keys and values, into which its own entries go (they
    are dropped after proposing anyway, so they never touch the pool)."""

    method = "eagle3"

    def __init__(self, head: Eagle3Head, num_speculative_tokens: int, max_num_seqs: int = 1,
                 capacity: int | None = None):
        super().__init__(num_speculative_tokens)
        self.head = head
        c = head.config
        self.aux_layers = head.aux_layers if c.use_aux_hidden_state else ()
        self.dtype = head.midlayer.self_attn.q_proj.weight.dtype
        self.device = head.midlayer.self_attn.q_proj.weight.device
        self.capacity = capacity or c.max_position_embeddings
        self.pool = DraftKVPool(c.num_kv_heads, c.head_dim, self.capacity, max(max_num_seqs, 1), self.dtype,
                                self.device)
        # fixed-shape steps by batch bucket (capture_graphs): the chain's, and read's
        self._graphs: dict[int, Replay] = {}
        self._read_graphs: dict[int, Replay] = {}
        self._fuse()

    def _fuse(self) -> None:
        """Inference-only forms of the head's weights (the head keeps the checkpoint's tensors, which the training
        script trains): q | k | v and gate | up as one GEMM each, q's rows scaled by 1 / sqrt(D) (the attention
        then has no scale op), o_proj and down_proj transposed for `addmm` (the residual add inside the GEMM),
        RoPE's cos / sin of every position the pool can hold as one table (a step looks its rows up: one op),
        draft -> target ids as one lookup."""
        c, att, mlp = self.head.config, self.head.midlayer.self_attn, self.head.midlayer.mlp
        d = c.head_dim
        with torch.no_grad():
            self._w_qkv = torch.cat([att.q_proj.weight * (1.0 / math.sqrt(d)), att.k_proj.weight, att.v_proj.weight])
            self._w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self._w_o, self._w_down = att.o_proj.weight.t(), mlp.down_proj.weight.t()
            self._ids = torch.arange(c.draft_vocab_size, device=self.device) + self.head.d2t
            # rows: positions 0 .. capacity - 1 (`has_room` keeps every entry, chain entries included, below it)
            cos, sin = self.head.rotary(torch.arange(self.capacity, device=self.device))
            # x * [cos | cos] + roll(x, D / 2) * [-sin | sin]: rotate-half RoPE in two ops
            self._rope = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)[:, :, None]
            self._span = torch.arange(self.capacity, device=self.device)
            # the chain's tokens are draft ids: their normed embeddings as one table where it is small (one lookup a
            # step instead of three ops)
            size = c.draft_vocab_size * c.hidden_size * self.dtype.itemsize
            self._draft_embeds = self._embed(self._ids) if size <= DRAFT_EMBED_TABLE_BYTES else None

    def _grow(self, slots: int) -> None:
        self.pool.grow(slots)
        self._graphs, self._read_graphs = {}, {}  # they captured the old pool's address

    def new_context(self, first: int, device: torch.device) -> DraftKV:
        if self.pool.full:
            self._grow(2 * self.pool.slots)
        return self.pool.take(first)

    def drop_context(self, ctx: DraftKV) -> None:
        self.pool.drop(ctx)

    def has_room(self, ctx: DraftKV, n: int) -> bool:
        return self.pool.has_room(ctx, n)

    # -- one draft step, at fixed shapes (no host sync): the eager paths and the graphs run these --

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normed embeddings [N, H] of target token ids [N] (the first half of q/k/v's input)."""
        return self.head.midlayer.input_layernorm(self.head.embed(tokens))

    def _embed_draft(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """`_embed` of draft-vocabulary ids."""
        if self._draft_embeds is not None:
            return self._draft_embeds[draft_ids]
        return self._embed(self._ids[draft_ids])

    def _enter(self, embedded: torch.Tensor, hidden: torch.Tensor, rope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries from their tokens' normed embeddings [N, H], hidden inputs [N, H] (fc of the target's features,
        or the draft's own pre-norm output) and RoPE rows [N, 2, 1, D] -> q [N, Hq, D] (scaled) and k [N, Hkv, D],
        both roped, in float32, v [N, Hkv, D] in the head's dtype, residual [N, H]."""
        c, layer = self.head.config, self.head.midlayer
        if c.norm_before_residual:
            h = residual = layer.hidden_norm(hidden)
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        qkv = F.linear(torch.cat([embedded, h], dim=-1), self._w_qkv).view(
            -1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = qkv[:, :c.num_heads + c.num_kv_heads]
        cos, sin = rope.unbind(1)
        # (the head's dtype times float32 promotes: the rotation is computed in float32, as the head was trained)
        qk = torch.addcmul(qk * cos, qk.roll(c.head_dim // 2, -1), sin)
        return qk[:, :c.num_heads], qk[:, c.num_heads:], qkv[:, c.num_heads + c.num_kv_heads:], residual

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
        """One query per context: q [B, Hq, D] over its context's keys and values kv [B, Hkv, 2, S, D] (float32)
        but those where hide [B, S] -> [B, Hq * D] in the head's dtype. (Written out: SDPA with a mask, float32
        and grouped heads falls back to its many-kernel math path on a GPU.)"""
        b, hq, d = q.shape
        s = torch.matmul(q.reshape(b, kv.shape[1], -1, d), kv[:, :, 0].transpose(-1, -2))
        s.masked_fill_(hide[:, None, None], float("-inf"))
        return torch.matmul(s.softmax(-1), kv[:, :, 1]).view(b, hq * d).to(self.dtype)

    def _exit(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [B, Hq * D] -> (pre-norm output [B, H]: the next entry's hidden input, its draft
        token [B] as a draft-vocabulary id)."""
        layer, head = self.head.midlayer, self.head
        residual = torch.addmm(residual, attn, self._w_o)
        gate, up = F.linear(layer.post_attention_layernorm(residual), self._w_gate_up).chunk(2, dim=-1)
        residual = torch.addmm(residual, F.silu(gate) * up, self._w_down)
        lm = head.lm_head if head.lm_head is not None else head.shared_lm_head
        # (argmax over the logits in the head's dtype: their float32 copy holds the same values)
        return residual, lm(head.norm(residual)).argmax(-1)

    def _read(self, tokens: torch.Tensor, features: torch.Tensor, rope: torch.Tensor, slot: torch.Tensor,
              idx: torch.Tensor, last: torch.Tensor, ctx_slot: torch.Tensor, hide: torch.Tensor, span: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Committed entries [N] (target token ids, target features [N, F], RoPE rows) written to the pool at
        (slot, idx) [N]; the output at each context's last entry `last` [B] (context pool rows `ctx_slot` [B], keys
        past its entry hidden by `hide` [B, span]) -> its draft ids [B] (draft vocabulary), its pre-norm output
        [B, H], and the contexts' keys and values as a float32 working copy [B, Hkv, 2, span, D] (the chain's)."""
        q, k, v, residual = self._enter(self._embed(tokens), self.head.combine(features), rope)
        self.pool.kv[slot, :, :, idx] = torch.stack([k, v], dim=2).to(self.dtype)
        kv = self.pool.kv[ctx_slot, :, :, :span].float()
        residual, first = self._exit(self._attend(q[last], kv, hide), residual[last])
        return first, residual, kv

    def _chain(self, embedded: torch.Tensor, residual: torch.Tensor, rope: torch.Tensor, kv: torch.Tensor,
               idx: torch.Tensor, hide: torch.Tensor) -> list[torch.Tensor]:
        """Chain entries from each context's last entry (its draft's normed embedding [B, H], pre-norm output
        residual [B, H]): entry s at RoPE rows rope[s] [B, 2, 1, D] goes into the working copy kv at idx[s] [B]
        and sees what hide[s] [B, span] does not hide -> the draft ids (draft vocabulary) of each entry, [B] each."""
        rows, drafted = self.pool.rows[:embedded.shape[0]], []
        for s in range(idx.shape[0]):
            q, k, v, residual = self._enter(embedded, residual, rope[s])
            kv[rows, :, :, idx[s]] = torch.stack([k, v], dim=2)
            residual, ids = self._exit(self._attend(q, kv, hide[s]), residual)
            drafted.append(ids)
            if s + 1 < idx.shape[0]:
                embedded = self._embed_draft(ids)
        return drafted

    def _targets(self, draft_ids: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary ids, [B] each -> target ids [B, len(draft_ids)] (into `out` if given)."""
        ids = torch.stack(draft_ids, dim=1)
        return torch.index_select(self._ids, 0, ids.view(-1), out=None if out is None else out.view(-1)).view(
            ids.shape)

    # -- the ChainDrafter steps --

    @torch.inference_mode()
    def read(self, ctxs: list[DraftKV], counts: list[int], token_ids: list[int], features: torch.Tensor,
             positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Eager (a prefill's entries, or no graphs): one upload of the entries' and contexts' ints, `_read`."""
        slot, idx, last, at = [], [], [], 0
        for ctx, n in zip(ctxs, counts, strict=True):
            slot += [ctx.slot] * n
            idx += range(ctx.length, ctx.length + n)
            ctx.length += n
            at += n
            last.append(at - 1)
        n, b = len(token_ids), len(ctxs)
        ints = to_device(token_ids + positions + slot + idx + last + [c.slot for c in ctxs]
                         + [idx[r] for r in last], torch.long, self.device)
        tok, pos, slot_t, idx_t = ints[:4 * n].view(4, n)
        last_t, ctx_slot, q_idx = ints[4 * n:].view(3, b)
        span = max(c.length for c in ctxs)
        first, residual, _ = self._read(tok, features.to(self.dtype), self._rope[pos], slot_t, idx_t, last_t,
                                        ctx_slot, self._span[:span] > q_idx[:, None], span)
        return residual, self._ids[first].tolist()

    @torch.inference_mode()
    def chain(self, seqs: list[DraftSeq], steps: int) -> list[list[int]]:
        b = len(seqs)
        # the graphs run k - 1 steps: fewer (requests near their end) read the first `steps` columns
        bucket = next((g for g in self._graphs if g >= b), None)
        if bucket is None:
            ints = to_device(self._chain_ints(seqs, b, steps), torch.long, self.device)
            span = max(s.ctx.length for s in seqs) + steps
            return self._chain_from(ints, torch.stack([s.hidden for s in seqs]), b, steps, span).tolist()
        static = self._static[bucket]
        self._stage(static)[:] = self._chain_ints(seqs, bucket, self.num_speculative_tokens - 1)
        self._send(static)
        torch.stack([s.hidden for s in seqs], out=self._chain_hidden[:b])
        return self._graphs[bucket]()[:b, :steps].tolist()

    def _chain_ints(self, seqs: list[DraftSeq], bucket: int, steps: int) -> list[int]:
        """The chain's packed ints: first drafts [bucket], pool rows [bucket], then per step the entries' positions
        and working-copy indices [steps, bucket] each; padding contexts: token 0 at position 0 on the scratch
        row."""
        pad = [0] * (bucket - len(seqs))
        out = [s.next_token for s in seqs] + pad + [s.ctx.slot for s in seqs] + [self.pool.scratch] * len(pad)
        for s in range(steps):
            out += [q.ctx.end + s for q in seqs] + pad
        for s in range(steps):
            out += [q.ctx.length + s for q in seqs] + pad
        return out

    def _chain_from(self, ints: torch.Tensor, hidden: torch.Tensor, bucket: int, steps: int, span: int
                    ) -> torch.Tensor:
        """The chain alone (after an eager read), from `_chain_ints` (the first drafts as target ids) and the last
        entries' pre-norm outputs -> target ids [bucket, steps]."""
        tok, ctx_slot = ints[:2 * bucket].view(2, bucket)
        pos, idx = ints[2 * bucket:].view(2, steps, bucket)
        kv = self.pool.kv[ctx_slot, :, :, :span].float()
        return self._targets(self._chain(self._embed(tok), hidden, self._rope[pos], kv, idx,
                                         self._span[:span] > idx[..., None]))

    @torch.inference_mode()
    def read_ahead(self, ctxs: list[DraftKV], counts: list[int], token_ids: list[int],
                   features: tuple[torch.Tensor, list[int]], positions: list[int]) -> DeviceDrafts | None:
        """The read graph over entries the host has settled (each context's n entries all committed), whose chain
        runs on the device from the read's outputs: one upload, one copy of the features, one replay (nothing
        waits here)."""
        b, width = len(ctxs), self.num_speculative_tokens + 1
        bucket = next((g for g in self._read_graphs if g >= b), None)
        if bucket is None or max(counts) > width:  # a prefill, or no graphs: `read` runs eagerly
            return None
        feats, rows = features
        if feats.shape[0] > bucket * width:  # (the step also held a prefill chunk: its rows, compacted)
            feats = torch.cat([feats[r:r + n] for r, n in zip(rows, counts, strict=True)])
            rows = [sum(counts[:i]) for i in range(b)]
        static = self._read_static[bucket]
        ints, at = ReadInts(self._stage(static), bucket, self.num_speculative_tokens), 0
        for i, (ctx, n, row) in enumerate(zip(ctxs, counts, rows, strict=True)):
            # all n entries committed: the device counts no accepted draft, `lim` says n - 1
            self._read_context(ints, i, ctx, n, row, positions[at], lim=n - 1)
            ints.verdict[row:row + n] = token_ids[at:at + n]
            ctx.length += n
            at += n
        self._send(static)
        self._features[:feats.shape[0]].copy_(feats)
        return DeviceDrafts(self._read_graphs[bucket]()[:b])

    @torch.inference_mode()
    def launch_unverified(self, ctxs: list[DraftKV], items: Sequence[tuple[str, int, int, int, int]],
                          logits: torch.Tensor, features: torch.Tensor, drafts: torch.Tensor) -> DeviceDrafts | None:
        """The read graph launched right behind a greedy verify step's forward: the verdict (how many drafts each
        request accepted) is worked out on the device from the step's argmax and the drafts it verified (the
        last read's, still in `_drafts_out`), so the host launches it before reading anything."""
        b, k = len(ctxs), self.num_speculative_tokens
        bucket = next((g for g in self._read_graphs if g >= b), None)
        if bucket is None:
            return None
        static = self._read_static[bucket]
        ints = ReadInts(self._stage(static), bucket, k)
        for i, (ctx, (_, start, n, row, first)) in enumerate(zip(ctxs, items, strict=True)):
            self._read_context(ints, i, ctx, n, row, start, lim=0)
            ints.drafts[i * k:i * k + n - 1] = range(first, first + n - 1)
            ints.valid[i * k:i * k + n - 1] = 1
        self._send(static)
        t = logits.shape[0]
        verdict = self._verdicts[bucket][:t]
        torch.argmax(logits, dim=1, out=verdict)  # into the verdict region, after the upload (stream order)
        self._verdict.send(torch.cat([verdict, drafts]))  # before the read overwrites those drafts
        self._features[:t].copy_(features)
        return DeviceDrafts(self._read_graphs[bucket]()[:b])

    def _read_context(self, ints: ReadInts, i: int, ctx: DraftKV, n: int, row: int, start: int, lim: int) -> None:
        """Context i's part of the read graph's ints: its n entries, whose features and tokens sit at the step's
        rows row .. row + n - 1, at positions start .., padded to k + 1 on the scratch row; `lim` is added to the
        accepted drafts the device counts."""
        r = i * (self.num_speculative_tokens + 1)
        ints.src[r:r + n] = range(row, row + n)
        ints.slot[r:r + n] = ctx.slot
        ints.idx[r:r + n] = range(ctx.length, ctx.length + n)
        ints.pos[r:r + n] = range(start, start + n)
        ints.ctx_slot[i], ints.lim[i] = ctx.slot, lim
        ints.base[:, i] = r, ctx.length, start  # its first entry's row, working-copy index, position

    def _draft_ahead(self, ints: torch.Tensor, bucket: int) -> torch.Tensor:
        """The read graph's body (`ReadInts` layout): the verdict (accepted drafts a per context: the leading
        valid drafts that equal the argmax before them, plus `lim`), then `_read` over `bucket` contexts of k + 1
        entries whose output is read at entry a, then the chain from there, all on the device -> drafts
        [bucket, k]. Each entry's token is the verdict region's value at its row: for a verify step the argmax
        there, which is the token after the entry's position for every entry up to a (an accepted draft equals
        it, and the one at a is the step's bonus token); entries past a are written where the next read
        overwrites them, and no query here sees them. One upload and one copy of the features (and of a verify
        step's argmax) feed the whole step."""
        k, w = self.num_speculative_tokens, self.num_speculative_tokens + 1
        p = ReadInts(ints, bucket, k)
        src = p.src.view(bucket, w)
        accepted = (p.verdict[src[:, :k]] == self._drafts_out.view(-1)[p.drafts.view(bucket, k)]) * p.valid.view(
            bucket, k)
        a = accepted.cumprod(1).sum(1) + p.lim
        last, q_idx, pos = (p.base + a).unbind(0)
        q_idx = q_idx + self._steps  # [k, bucket]: the read's last entry's working-copy index, then the chain's
        hide = self._span > q_idx[..., None]
        first, residual, kv = self._read(p.verdict[p.src], self._features[p.src], self._rope[p.pos], p.slot, p.idx,
                                         last, p.ctx_slot, hide[0], self.capacity)
        out = [first]
        if k > 1:
            out += self._chain(self._embed_draft(first), residual, self._rope[pos + 1 + self._steps[:-1]], kv,
                               q_idx[1:], hide[1:])
        # into a buffer made outside every capture: the drafts stay on the device while the chain graph may replay
        # (after an eager read), and memory a graph allocated in the shared pool can be another graph's scratch
        return self._targets(out, out=self._drafts_out[:bucket])

    def _stage(self, static: torch.Tensor) -> np.ndarray:
        """The host staging buffer of a graph's packed static ints, holding their defaults (padding), to fill and
        `_send` (its upload of the step before is long done: the host has read a verify since)."""
        ring, defaults = self._staging[static.data_ptr()]
        host = ring.take().numpy()
        host[:] = defaults
        return host

    def _send(self, static: torch.Tensor) -> None:
        """One upload of the staging buffer into the static ints, queued without a host wait."""
        self._staging[static.data_ptr()][0].upload(static)

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs per batch bucket, captured now (serving never stalls on a capture): `read` of up to k + 1
        committed entries per request (what a verify step commits) followed by the chain on its outputs
        (`_draft_ahead`), and the chain alone (k - 1 draft steps, after a read that ran eagerly). Each bucket reads
        one packed static int buffer, filled by one upload. Off CUDA, the same fixed-shape steps run eagerly on
        the same static buffers."""
        if self.pool.slots < max_num_seqs:
            self._grow(max_num_seqs)
        c, n, k = self.head.config, max_num_seqs, self.num_speculative_tokens
        i64 = dict(dtype=torch.long, device=self.device)
        features = 3 * c.target_hidden_size if c.use_aux_hidden_state else c.hidden_size
        self._features = torch.zeros(n * (k + 1), features, dtype=self.dtype, device=self.device)
        self._chain_hidden = torch.zeros(n, c.hidden_size, dtype=self.dtype, device=self.device)
        self._drafts_out = torch.zeros(n, k, **i64)  # the read graphs' drafts (`_draft_ahead`)
        self._steps = torch.arange(k, **i64)[:, None]  # a chain's entries after the read's last one
        self._read_static, self._static, self._staging, self._verdicts = {}, {}, {}, {}
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        with torch.inference_mode():
            for b in batch_buckets(n):
                # padding: token 0 at position 0 on the scratch row (its values never reach a real request)
                defaults = np.zeros(ReadInts.size(b, k), dtype=np.int64)
                pad = ReadInts(defaults, b, k)
                pad.slot[:] = pad.ctx_slot[:] = self.pool.scratch
                ints = self._read_static[b] = torch.from_numpy(defaults).to(self.device)
                self._staging[ints.data_ptr()] = self._staging_for(ints)
                self._verdicts[b] = ints[-b * (k + 1):]  # `ReadInts.verdict`, which a verify step's argmax fills
                self._read_graphs[b] = Replay(lambda b=b, ints=ints: self._draft_ahead(ints, b), pool, self.device)
                if k > 1:
                    ints = self._static[b] = torch.zeros(2 * b + 2 * (k - 1) * b, **i64)
                    ints[b:2 * b] = self.pool.scratch
                    self._staging[ints.data_ptr()] = self._staging_for(ints)
                    self._graphs[b] = Replay(lambda b=b, ints=ints: self._chain_fixed(ints, b), pool, self.device)

    def _staging_for(self, static: torch.Tensor) -> tuple[UploadRing, np.ndarray]:
        """A host staging buffer for `static` and the static ints' defaults (their values now)."""
        return UploadRing(static.shape, static.dtype, self.device), static.cpu().numpy().copy()

    def _chain_fixed(self, ints: torch.Tensor, bucket: int) -> torch.Tensor:
        """The chain graph's body: `ints` in `_chain_ints`' layout, the last entries' pre-norm outputs in
        `_chain_hidden`."""
        steps = self.num_speculative_tokens - 1
        return self._chain_from(ints, self._chain_hidden[:bucket], bucket, steps, self.capacity)
