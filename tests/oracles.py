"""Independent oracles shared by several test files (plain loops written from the spec's formulas)."""

import torch


def canon_loop(x, w, b=None, residual=True, activation=False, init=None):
    """y[:, t] = [x_t +] act(b + sum_i w[:, i] * x[:, t-K+1+i]), history zeros or init; plain loops in x's dtype."""
    B, T, Ch = x.shape
    K = w.shape[1]
    hist = [init[:, :, j] for j in range(K - 1)] if init is not None else [x.new_zeros(B, Ch)] * (K - 1)
    seq = hist + [x[:, t] for t in range(T)]  # seq[t + K - 1] = x_t
    out = []
    for t in range(T):
        z = b.expand(B, Ch) if b is not None else x.new_zeros(B, Ch)
        for i in range(K):
            z = z + w[:, i] * seq[t + i]
        if activation:
            z = z * torch.sigmoid(z)
        out.append(x[:, t] + z if residual else z)
    return torch.stack(out, dim=1)
