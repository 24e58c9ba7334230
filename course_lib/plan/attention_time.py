"""Ring attention or Ulysses: which wins, from a time model of one attention layer.

Both split a sequence over C ranks and compute the same attention; they differ in what they
send and whether it hides. The ring (``parallel.context``) passes K/V chunks to a neighbour
while it computes, so its messages hide once a block's compute, which grows as (S/C)², outlasts
a chunk's transfer, which grows as S/C: long sequences. Ulysses (``parallel.ulysses``) sends
fewer bytes, in all-to-alls the attention must wait for: it wins where the ring's messages
cannot hide (short sequences, slow links) and where the all-to-all has fast links to every peer
(one node's NVLink). Notebook 12 plots the two against the sequence length.

Paper: Jacobs et al., "DeepSpeed Ulysses", arXiv:2309.14509; Liu et al., "Ring Attention with
Blockwise Transformers", arXiv:2310.01889.
"""

from __future__ import annotations

from ..checks import check_int, check_number
from ..parallel.context_chunks import SequenceChunks
from ..parallel.ulysses import ulysses_bytes_per_rank


def attention_time_model(
    *,
    seq: int,
    heads: int,
    head_dim: int,
    degree: int,
    flops_per_s: float,
    link_bytes_per_s: float,
    latency_s: float = 0.0,
    batch: int = 1,
    element_bytes: int = 2,
    all_to_all_bytes_per_s: float | None = None,
) -> dict[str, float]:
    """Predicted seconds of one causal attention layer, forward and backward, per rank: ring or Ulysses.

    The compute is the same for both, divided by C (zig-zag balances the ring): 4·b·h·S²·d FLOPs
    forward, halved by the causal mask, twice that backward. What differs is the communication:

    - **ring**: each of the C steps sends one K/V chunk (backward also its gradients) *while*
      computing one block, so a step takes the longer of the two: the messages are hidden when
      a block's compute (∝ (S/C)²) outlasts a chunk's transfer (∝ S/C), i.e. for long sequences;
    - **Ulysses**: four all-to-alls each way, fewer bytes (``ulysses_bytes_per_rank``), but the
      attention waits for them: nothing hides them.

    Args:
        seq: S, the sequence.
        heads: H (Ulysses needs C <= H, the query heads).
        head_dim: d.
        degree: C, the ranks sharing the sequence.
        flops_per_s: the attention kernel's achieved rate per rank.
        link_bytes_per_s: what one rank's link to one peer carries (the ring's neighbour).
        latency_s: the start-up time of one message (alpha).
        batch: sequences.
        element_bytes: 2 in bf16.
        all_to_all_bytes_per_s: what one rank's all-to-all carries, over its links to every peer
            at once: on a fully connected node (NVLink all-to-all), C - 1 links; None: one link,
            as between nodes where each GPU has one NIC.
    """
    for name, value in (("heads", heads), ("head_dim", head_dim), ("degree", degree), ("batch", batch)):
        check_int(name, value, minimum=1)
    check_int("seq", seq, minimum=degree)
    for name, value in (("flops_per_s", flops_per_s), ("link_bytes_per_s", link_bytes_per_s)):
        check_number(name, value, above=0)
    check_number("latency_s", latency_s, minimum=0)
    forward = 4 * batch * heads * seq**2 * head_dim / 2 / degree / flops_per_s
    backward = 2 * forward
    chunk = 2 * batch * heads * (seq / degree) * head_dim * element_bytes  # K and V of S/C tokens
    message = latency_s + chunk / link_bytes_per_s
    steps = degree - 1
    ring = (
        steps * max(forward / degree, message) + forward / degree  # the last block: nothing left to send
        + steps * max(backward / degree, 2 * message) + backward / degree + message  # the gradients go home
    )  # fmt: skip
    chunks = SequenceChunks(seq, degree, zigzag=False)
    per_token = batch * heads * head_dim * element_bytes
    exchanged = ulysses_bytes_per_rank(chunks, 0, bytes_per_token=per_token)
    all_to_all = link_bytes_per_s if all_to_all_bytes_per_s is None else all_to_all_bytes_per_s
    check_number("all_to_all_bytes_per_s", all_to_all, above=0)
    ulysses = forward + backward + 4 * latency_s + exchanged / all_to_all
    if degree == 1:
        ring = ulysses = forward + backward
    return {"compute_s": forward + backward, "ring_s": ring, "ulysses_s": ulysses}
