"""A small Transformer whose attention blocks get FLOATER's Q/K/V biases
(FloaterAttentionBias, the paper's Eq. 12-13), cached at inference.

The biases depend on the positions only, never on the tokens. In training they are
recomputed on every step (gradients reach the ODE's dynamics); in eval mode they are
integrated once and every later call reuses them; a longer sequence integrates only its
new positions, onwards from the last cached state. The script counts the calls of the op
``posenc_fast::floater`` (``floater_taped`` in training on the cpp backend) with
torch.profiler to show it.

Task: output the token one position earlier. Attention without positions cannot do it (it
treats the sequence as a set), so the model has to learn positions from FLOATER's biases.

    python examples/floater_attention.py     # a few seconds on a CPU
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import posenc_fast as pf

# the integration (a training call on the cpp backend runs its taped form)
OPS = ("posenc_fast::floater", "posenc_fast::floater_taped")


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, bias):  # x [B, L, dim], bias [3, L, dim] for Q, K, V
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, -1)) + bias.transpose(0, 1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv.unbind(-2))
        y = F.scaled_dot_product_attention(q, k, v)  # no mask: positions come from FLOATER
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=16, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # One shared ODE drives the Q, K and V biases of every block (S = 2 * 3 states).
        self.pos = pf.FloaterAttentionBias(dim, num_layers=layers, delta_t=0.1)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):  # [B, L] -> logits [B, L, vocab]
        x = self.embed(tokens)
        bias = self.pos(tokens.shape[1])  # [layers, 3, L, dim]: cached in eval mode
        for n, block in enumerate(self.blocks):
            x = block(x, bias[n])
        return self.out(x)


def make_batch(n, length, vocab, generator):
    tokens = torch.randint(0, vocab, (n, length), generator=generator)
    return tokens, torch.roll(tokens, 1, dims=1)  # the previous token (the first wraps)


def op_calls(prof):
    """Lengths of the time grids of every FLOATER integration the profiler saw."""
    return [e.input_shapes[5][0] for e in prof.events() if e.name in OPS]


def main(steps=150, length=16, vocab=16):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TinyTransformer(vocab)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []

    def train_step():
        tokens, target = make_batch(32, length, vocab, g)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())

    profiled = 3  # the last few training steps run under the profiler
    for _ in range(steps - profiled):
        train_step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(profiled):
            train_step()
    train_calls = op_calls(prof)

    model.eval()
    tokens, target = make_batch(64, length, vocab, g)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        accuracy = [(model(tokens).argmax(-1) == target).float().mean().item() for _ in range(5)]
    eval_calls = op_calls(p)

    longer = make_batch(8, 2 * length, vocab, g)[0]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        model(longer)  # 2 * length positions: only the new ones are integrated
        model(longer[:, : length + 3])  # shorter than the cache: no integration at all
    extension_calls = op_calls(p)

    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval accuracy {accuracy[0]:.1%}")
    print(f"training: {len(train_calls)} integrations in {profiled} steps (one per step)")
    print(f"eval: {len(eval_calls)} integration in {len(accuracy)} calls")
    print(f"a {2 * length}-token sequence after {length}-token ones: integrated {extension_calls}")
    return {
        "losses": losses,
        "accuracy": accuracy,
        "train_calls": train_calls,
        "eval_calls": eval_calls,
        "extension_calls": extension_calls,
    }


if __name__ == "__main__":
    main()
