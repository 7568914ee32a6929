"""What a task's closing table is read against: the paper's numbers for the task's hardest setting, and what
guessing scores where a chance level needs words.

``PAPER[name]`` (str) is printed under a run's closing table (``canonlm.train.run.format_table``) as "read against".
The numbers are the paper's Fig. 7 (12L768D Llama, best of 4 learning rates; Part 4.1, Results 2-5) and, for Capo,
Part 4.1 §5.1 / Result 5 and Part 3.3 (bits per parameter). The CPU presets are far smaller than these runs: read
the direction (Canon against no Canon, RoPE against NoPE), not the level.

``CHANCE_NOTE[name]`` (str) says why a generation task's chance level is (about) 0.
"""

from __future__ import annotations

PAPER: dict[str, str] = {
    "depo1": "paper Fig. 7, 12L768D, Depo1 K=8, N=375, acc@8 / acc@4: RoPE 0 / 0 %, RoPE + Canon-ABCD 97 / 100 %",
    "depo2": "paper Fig. 7, 12L768D, Depo2 K=16, N=125, acc@16 / acc@8: RoPE 1 / 50 %, RoPE + Canon-ABCD 96 / 100 %, "
    "NoPE 0 %",
    "brevo1": "paper Fig. 7, 12L768D, Brevo1 N=110, valid topological order: NoPE 0 %, NoPE + Canon-ABCD 84.9 %, "
    "RoPE 27.5 %, RoPE + Canon-ABCD 58.8 %",
    "brevo2": "paper Fig. 7, 12L768D, Brevo2 N=50, valid topological order: RoPE 81.4 %, RoPE + Canon-ABCD 87.8 %",
    "mano": "paper Fig. 7, 12L768D, Mano L=16, exact answer: NoPE ~7 %, NoPE + Canon-ABCD 94.3 %, RoPE 41.6 %, "
    "RoPE + Canon-ABCD 83.0 %",
    "lano": "paper Fig. 7 / 24, 12L768D, Lano cfg3k, generation accuracy: NoPE 0 %, NoPE + Canon-ABCD 53.1 %, "
    "RoPE 79.1 %, RoPE + Canon-ABCD 86.7 %; KL (RoPE) 0.00131",
    "capo": "Part 4.1 §5.1 (Result 5): Canon-ABCD raises Llama (RoPE) bits per parameter by 10-15 % at 100 "
    "exposures; Part 3.3: GPT-2 stores >= 1 bit per parameter at 100 exposures, Llama up to 1.3x less",
    "fullcopy": "paper Fig. 5: a 1-layer RoPE model needs d_model >= 128 to copy 500 tokens exactly; with Canon "
    "layers a far smaller one does",
}

_BREVO = (
    "a guessed list of names is rarely a valid topological order; not 0 at small N, where a query with one "
    "ancestor is a 1-in-(N-1) guess"
)
CHANCE_NOTE: dict[str, str] = {
    "brevo1": _BREVO,
    "brevo2": _BREVO,
    "lano": "a guessed string is almost never a sentence of the grammar",
    "fullcopy": "a guessed copy is right with probability 1/n!",
}
