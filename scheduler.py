"""
scheduler.py: who runs in each engine step, and how the block pool is shared when memory
is tight.

  SamplingParams  how a request picks its tokens (vLLM's names), checked when made
  BeamSearchParams  the same for a beam search (LLM.beam_search)
  Sequence        one request's state (a request with n > 1 samples becomes n sequences,
                  a beam search one per beam)
  hash_block      the prefix hash of a full block
  root_hash       the hash a sequence's chain starts from: a cache_salt's keeps tenants apart
  Scheduler       FCFS continuous batching under a token budget (or by priority, then
                  arrival), chunked prefill,
                  preemption by recomputing or by swapping to CPU memory, prefix caching,
                  forks for parallel sampling and beam search; schedule() returns a
                  SchedulerOutput, one step's work

The scheduler is handed the BlockPool (nanopaged.py) as an object and uses only its
block_size, num_blocks, num_available, ref_count, new_table, lookup, register, say, and
pending_copies (the copy-on-write copies its allocations recorded, which schedule() moves
into SchedulerOutput.copies for the engine to run); of each BlockTable, slots_for,
blocks_needed, append_cached, fork, release, pool, block_ids, num_tokens, num_dropped and
skip_dropped (both trivial without a window), and under a sliding window drop_before. With
swapping, it is handed a second BlockPool in CPU memory (the swap space); swapping uses both
pools' allocate and new_table and a table's append_moved (_move_table), the swap space's
num_free and a table's num_held (_make_room), and the engine copies the blocks it lists in
SchedulerOutput.swap_out / swap_in. It never imports the engine, so it can be read - and
tested - without a model.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import math
import numbers
import re
import reprlib
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import NamedTuple


# -----------------------------------------------------------------------------
# Request parameters: SamplingParams, BeamSearchParams, and the checks they share

MAX_LOGPROB_TOKEN_IDS = 128   # vLLM's bound on logprob_token_ids
MAX_N = 4096   # samples a request: its steps move each one through the queues and outputs one by
              # one (n = 100,000: 6 s for a step that forks and ends them all, the other requests waiting)


class RequestOutputKind(Enum):
    """vLLM's: what LLM.step() returns of a request before it ends. CUMULATIVE: at each step
    it sampled in, all its output so far; DELTA: what each step added (the outputs add up
    to the final one); FINAL_ONLY: nothing until it ends. Its final output comes in every
    case. generate() and stream() set FINAL_ONLY on their requests' copies, as vLLM's
    offline LLM does; a beam search has only a final output."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)   # (vLLM's fields come in another order: a positional argument would land elsewhere)
class SamplingParams:
    """How to pick a request's tokens (vLLM's names). temperature 0 is greedy."""
    n: int = 1                          # parallel samples of one prompt (prefilled once, then forked;
                                        # those left without a seat wait: Scheduler._defer)
    temperature: float = 1.0
    top_k: int = 0                      # 0 (or -1): all tokens
    top_p: float = 1.0
    min_p: float = 0.0                  # keep the tokens at least min_p times as likely as the likeliest
    max_tokens: int | None = 16         # None: as many as the model's context leaves, or the whole
                                        # KV pool where that holds less (LLM fills it in)
    stop: list[str] | str | None = None  # stop strings (the engine checks the text)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True    # the text leaves out special tokens (<|im_end|>...); the ids keep them
    include_stop_str_in_output: bool = False   # the text ends after the stop string, not before
    detokenize: bool = True             # False: token ids only, no text (and no decoded_token in the
                                        # logprobs), as vLLM's throughput benchmark asks; no stop strings
    logprobs: int | None = None         # per output token: its log-probability, and the top k tokens
                                        # (the chosen one may be among them)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Scoring (vLLM 0.34's): the logprobs of given tokens, say the labels of a classifier
    logprob_token_ids: list[int] | None = None  # per output token: the chosen one's, then these
                                        # tokens' in place of the top k (logprobs = None or as many)
    prompt_logprob_token_ids: list[list[int]] | None = None   # (rows, ids) of token ids, -1 padding:
                                        # row i's tokens scored as prompt token start + i + 1, into
                                        # RequestOutput.prompt_token_id_logprobs
    prompt_logprob_start: int | None = None   # both prompt scorings begin after this position (None
                                        # before it), so the prefix cache may serve the tokens up to it
    skip_reading_prefix_cache: bool | None = None   # True: the prompt is computed whole, no cached block
                                        # read (vLLM's None is True where the prompt is scored, reading
                                        # nothing before prompt_logprob_start; nanopaged's reads what it may)
    # Penalties, applied to the logits before temperature (see process_logits in nanopaged.py):
    presence_penalty: float = 0.0       # > 0: less of any token the output already has
    frequency_penalty: float = 0.0      # > 0: less of a token, the more the output has it
    repetition_penalty: float = 1.0     # > 1: less of any token of the prompt or output
    min_tokens: int = 0                 # no EOS, stop token or stop string before this many tokens
    truncate_prompt_tokens: int | None = None   # keep only k tokens of the prompt: its last, but for the
                                        # special tokens the tokenizer put around a text (a BOS), which
                                        # stay (-1: all that fit)
    repetition_detection: RepetitionDetectionParams | None = None   # end an output that loops (or a
                                        # dict of its fields): finish_reason "repetition"
    # Constraints, also before temperature (so greedy decoding obeys them too):
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None      # draw only these
    bad_words: list[str] | None = None              # never complete one of these words
    # vLLM's, taken at what nanopaged does: it decodes as HF's fast tokenizers do, which is
    # vLLM's spaces_between_special_tokens=True (True only); extra_args are kept, unused (as
    # by vLLM's own sampling)
    spaces_between_special_tokens: bool = True
    extra_args: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # (any: see RequestOutputKind)
    # Filled by LLM._check_constraints (from LLM._add) in the request's copy: bad_words as
    # token ids, both spellings (with the model's tokenizer, as vLLM does), and a (vocab,)
    # bool tensor on the engine's device, True outside allowed_token_ids (made once: a list
    # of ids to a tensor every step took 3 ms for half of a 49k vocabulary)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    disallowed_mask: object = field(default=None, init=False, repr=False, compare=False)
    # Set by LLM._add when the request came with a BeamSearchParams (LLM.beam_search, or one
    # given to generate or add_request). Such a request's sequences are beams, whose
    # tokens LLM._beam_step chooses in place of sampling (n is beam_width, its seats)
    beam: BeamSearchParams | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # Every value is checked here, when the request is made: a bad one found later,
        # in the middle of an engine step, would fail the whole batch.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        # vLLM's spellings: seed -1 is no seed; logprobs=True (prompt_logprobs=True) is 1
        if is_integer(self.seed) and self.seed == -1:
            self.seed = None
        self.logprobs = 1 if self.logprobs is True else self.logprobs
        self.prompt_logprobs = 1 if self.prompt_logprobs is True else self.prompt_logprobs
        id_rows = None if self.prompt_logprob_token_ids is None else _token_id_rows(self.prompt_logprob_token_ids)
        # (the checks below are all evaluated before the first failure is refused: one that reads
        # another field, a stop list's length or truth, tests its type first, so that a bad value
        # there, a numpy array say, gets its own message and not numpy's "truth value ... ambiguous")
        stops = isinstance(self.stop, (list, tuple)) and len(self.stop)
        num_ids = len(self.logprob_token_ids) if isinstance(self.logprob_token_ids, (list, tuple)) else None
        checks = [
            (is_integer(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}] (a step moves "
             f"each sample on its own: more would hold up every other request; split them), got {self.n!r}"),
            (_finite_number(self.temperature) and 0 <= self.temperature <= 2,
             f"temperature must be a number in [0, 2] (vLLM's range), got {self.temperature!r}"),
            (is_integer(self.top_k) and self.top_k >= -1,
             f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}"),
            (_finite_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be a number in (0, 1], got {self.top_p!r}"),
            (_finite_number(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be a number in [0, 1], got {self.min_p!r}"),
            _max_tokens_check(self.max_tokens),
            (self.stop is None or (isinstance(self.stop, (list, tuple))
                                   and all(isinstance(s, str) and s for s in self.stop)),
             f"stop must be a non-empty string or a list of them, got {reprlib.repr(self.stop)}"),
            (self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple, set))
                                             and all(is_integer(t) for t in self.stop_token_ids)),
             f"stop_token_ids must be a list of integers, got {reprlib.repr(self.stop_token_ids)}"),
            (self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**63),
             f"seed must be an integer in [0, 2**63), or -1 or None (no seed), got {self.seed!r}"),
            *[(isinstance(x, bool), f"{name} must be True or False, got {x!r}")
              for name, x in (("ignore_eos", self.ignore_eos), ("skip_special_tokens", self.skip_special_tokens),
                              ("include_stop_str_in_output", self.include_stop_str_in_output),
                              ("detokenize", self.detokenize))],
            (self.repetition_detection is None or isinstance(self.repetition_detection, RepetitionDetectionParams)
             or (isinstance(self.repetition_detection, dict) and set(self.repetition_detection) <= REPETITION_FIELDS),
             f"repetition_detection must be None, a RepetitionDetectionParams or a dict of its fields "
             f"({', '.join(sorted(REPETITION_FIELDS))}), got {reprlib.repr(self.repetition_detection)}"),
            (self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool),
             f"skip_reading_prefix_cache must be None, True or False, got {self.skip_reading_prefix_cache!r}"),
            (self.detokenize is not False or not stops, "stop strings are found in the text: they need detokenize=True"),
            (self.spaces_between_special_tokens is True, f"spaces_between_special_tokens="
             f"{self.spaces_between_special_tokens!r}: nanopaged decodes as HF's fast tokenizers do, which is "
             f"vLLM's True (it takes True)"),
            (self.extra_args is None or isinstance(self.extra_args, dict),
             f"extra_args must be None or a dict, got {self.extra_args!r}"),
            (isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"),
            *[(_finite_number(x) and -2 <= x <= 2, f"{name} must be a number in [-2, 2], got {x!r}")
              for name, x in (("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty))],
            (_finite_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"),
            truncate_prompt_tokens_check(self.truncate_prompt_tokens),
            (is_integer(self.min_tokens) and self.min_tokens >= 0
             and (not is_integer(self.max_tokens) or self.min_tokens <= self.max_tokens),   # (a bad max_tokens: its own message)
             f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens!r}], got {self.min_tokens!r}"),
            # (at most LLM(max_logprobs), 20 by default: the engine checks that, knowing the vocabulary)
            *[(k is None or (is_integer(k) and k >= -1),
               f"{name} must be None, -1 (the whole vocabulary) or an integer >= 0, got {k!r}")
              for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))],
            (self.logprob_token_ids is None or (isinstance(self.logprob_token_ids, (list, tuple))
                                                and 0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS
                                                and all(is_integer(t) for t in self.logprob_token_ids)),
             f"logprob_token_ids must be a non-empty list of at most {MAX_LOGPROB_TOKEN_IDS} token ids, "
             f"got {reprlib.repr(self.logprob_token_ids)}"),
            (num_ids is None or not is_integer(self.logprobs) or self.logprobs == num_ids,
             f"logprobs = {self.logprobs!r} with {num_ids} logprob_token_ids: where both "
             f"are given, logprobs must be their number (as vLLM asks)"),
            (self.prompt_logprob_token_ids is None or id_rows is not None,
             f"prompt_logprob_token_ids must be a non-empty list of non-empty lists of token ids (-1: padding), "
             f"or a 2-D integer array, got {reprlib.repr(self.prompt_logprob_token_ids)}"),
            (self.prompt_logprob_start is None or (is_integer(self.prompt_logprob_start)
                                                   and self.prompt_logprob_start >= 0),
             f"prompt_logprob_start must be None or an integer >= 0, got {self.prompt_logprob_start!r}"),
            (self.prompt_logprob_start is None or self.scores_prompt,
             "prompt_logprob_start is where prompt scoring begins: it needs prompt_logprobs or "
             "prompt_logprob_token_ids"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                (is_integer(t) or (isinstance(t, str) and re.fullmatch(r"\s*-?[0-9]{1,18}\s*", t)))
                and isinstance(b, numbers.Real) and not isinstance(b, bool) and b == b   # (NaN != NaN)
                for t, b in self.logit_bias.items())),
             f"logit_bias must be a dict of token id -> bias (a number), got {reprlib.repr(self.logit_bias)}"),
            (self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, (list, tuple, set))
                                                and self.allowed_token_ids
                                                and all(is_integer(t) for t in self.allowed_token_ids)),
             f"allowed_token_ids must be a non-empty list of integers, got {reprlib.repr(self.allowed_token_ids)}"),
            (self.bad_words is None or (isinstance(self.bad_words, (list, tuple))
                                        and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             f"bad_words must be a list of words (strings that are not blank), got {reprlib.repr(self.bad_words)}"),
        ]
        _refuse_the_first_failed(checks)
        # plain Python numbers from here on
        self.n, self.top_k = int(self.n), int(self.top_k)
        self.max_tokens = None if self.max_tokens is None else int(self.max_tokens)
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)
        self.repetition_penalty, self.min_tokens = float(self.repetition_penalty), int(self.min_tokens)
        self.seed = None if self.seed is None else int(self.seed)
        # (as vLLM: None becomes [], so that a script may append to stop, stop_token_ids, bad_words)
        self.stop = [] if self.stop is None else list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        self.prompt_logprobs = None if self.prompt_logprobs is None else int(self.prompt_logprobs)
        rd = self.repetition_detection   # made anew, so checked again (its fields may have changed
        if isinstance(rd, dict):          # since), as its own class; a dict as an OpenAI request's JSON gives it
            self.repetition_detection = RepetitionDetectionParams(**rd)
        elif rd is not None:
            self.repetition_detection = replace(rd)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = [int(t) for t in self.logprob_token_ids]
        self.prompt_logprob_token_ids = id_rows
        if self.prompt_logprob_start is not None:
            self.prompt_logprob_start = int(self.prompt_logprob_start)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = int(self.truncate_prompt_tokens)
        if self.logit_bias is not None:   # (string ids, as in an OpenAI request's JSON; clamped as OpenAI does,
            # which also keeps an infinite bias from making the softmax NaN)
            bias = {int(t): float(min(max(b, -100), 100)) for t, b in self.logit_bias.items()}
            if len(bias) < len(self.logit_bias):   # ("5" and 5: which bias would win?)
                raise ValueError(f"logit_bias gives a token id twice (as a number and a string), "
                                 f"got {reprlib.repr(self.logit_bias)}")
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted({int(t) for t in self.allowed_token_ids})
        self.bad_words = [] if self.bad_words is None else list(self.bad_words)

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's: how many logprobs each output token gets besides its own; None: no logprobs."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    @property
    def scores_prompt(self) -> bool:
        """Whether the request scores its prompt: its logits there are needed, not only the last's."""
        return self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's): the lists and dicts in it are the copy's own."""
        return copy.deepcopy(self)


# (numpy's integers and floats are welcome, being numbers.Integral and numbers.Real; a torch
# tensor is not, even a 0-d one, and bools are not numbers here)
def is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_one_of(x, options: tuple) -> bool:
    """x in options, for a value of any type: `in` compares with ==, which a numpy array or a
    tensor answers element by element (and its truth is then "ambiguous": numpy's error, or
    torch's, in place of the caller's message), so only a plain value is compared (a str, a
    number, None, or a dict, list or tuple: vLLM's options take {} for none)."""
    return isinstance(x, (str, numbers.Number, type(None), dict, list, tuple)) and x in options


def check_priority(priority):
    """A request's priority (LLM(scheduling_policy="priority")): any integer, lower first."""
    if not is_integer(priority):
        raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")


def _token_id_rows(rows) -> list[list[int]] | None:
    """prompt_logprob_token_ids as rows of equal length, padded with -1 (a list of lists, or a
    2-D integer array such as numpy's); None if it is not one."""
    # (a 2-D array, numpy's or torch's: its tolist() gives Python numbers, checked below as a list's are)
    rows = rows.tolist() if getattr(rows, "ndim", None) == 2 else rows
    if not isinstance(rows, (list, tuple)) or not rows:
        return None
    if not all(isinstance(r, (list, tuple)) and r and all(is_integer(t) and t >= -1 for t in r) for r in rows):
        return None
    width = max(map(len, rows))
    return [[int(t) for t in r] + [-1] * (width - len(r)) for r in rows]


def _max_tokens_check(max_tokens) -> tuple[bool, str]:
    return (max_tokens is None or (is_integer(max_tokens) and max_tokens >= 1),
            f"max_tokens must be None (up to the context) or an integer >= 1, got {max_tokens!r}")


def truncate_prompt_tokens_check(keep) -> tuple[bool, str]:
    """(SamplingParams' field, and tokenization_kwargs' key: what -1 keeps differs, see their users)"""
    return (keep is None or (is_integer(keep) and (keep >= 1 or keep == -1)),
            f"truncate_prompt_tokens must be None, -1 (all that fit) or an integer >= 1, got {keep!r}")


def _refuse_the_first_failed(checks: list[tuple[object, str]]):
    """checks: (ok, the message if not; ok is any truthy value: True, a match, a list).
    Raises ValueError with the first failure's message."""
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def _finite_number(x) -> bool:
    """A real number (not a bool) that a float can hold: 10**400 is finite but unusable."""
    try:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))
    except OverflowError:
        return False


@dataclass
class RepetitionDetectionParams:
    """vLLM's: an output ends (finish_reason "repetition") once its last tokens are a pattern
    of k tokens repeated min_count times back to back, for some k from min_pattern_size (0:
    1) to max_pattern_size (0: never). Small models' greedy decoding falls into such loops,
    and would go on to max_tokens. Not before min_tokens."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self):
        sizes = (all(is_integer(x) and x >= 0 for x in (self.max_pattern_size, self.min_pattern_size, self.min_count))
                 and self.min_pattern_size <= self.max_pattern_size)
        _refuse_the_first_failed([
            (sizes, f"repetition_detection's max_pattern_size, min_pattern_size and min_count must be integers >= 0, "
                    f"min_pattern_size <= max_pattern_size, got {self}"),
            (not sizes or self.max_pattern_size == 0 or self.min_count >= 2,   # (a str compared: TypeError)
             f"repetition_detection's min_count must be >= 2 (a pattern seen once is no repetition), got {self}"),
        ])

    def ends_in_a_loop(self, ids: list[int]) -> bool:
        """Whether ids (an output's tokens) end with a pattern repeated min_count times."""
        for k in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if k * self.min_count > len(ids):
                return False
            tail = ids[-k:]
            if all(ids[-k * (m + 1):-k * m] == tail for m in range(1, self.min_count)):
                return True
        return False


REPETITION_FIELDS = frozenset(f.name for f in fields(RepetitionDetectionParams))   # (a dict of them is taken too)


@dataclass
class BeamSearchParams:
    """How LLM.beam_search searches (vLLM's names). Each step, every beam's 2 * beam_width
    likeliest next tokens are candidates, and the beam_width best of all candidates by
    cumulative log-probability live on; one that ends in EOS is put aside, finished. The
    results are ranked by cumulative logprob / (output tokens, a final EOS counted) **
    length_penalty, as vLLM (0.33 on) and transformers rank them: the larger, the more it
    favours longer outputs (0: by the cumulative logprob alone)."""
    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0            # (vLLM's; nanopaged ranks by the model's own logprobs: 0 only)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False   # True: generate()'s beam texts keep a final EOS, where
                                        # skip_special_tokens lets them (beam_search()'s keep it as
                                        # that allows, as vLLM's; the tokens always hold it)
    skip_special_tokens: bool = True    # special tokens left out of the beams' texts (vLLM 0.30 on)
    allowed_token_ids: list[int] | None = None   # candidates only among these (vLLM 0.34's), ranked
                                        # by the model's own logprobs over the whole vocabulary

    def __post_init__(self):
        checks = [
            (is_integer(self.beam_width) and 1 <= self.beam_width <= MAX_N,
             f"beam_width must be an integer in [1, {MAX_N}] (as n), got {self.beam_width!r}"),
            _max_tokens_check(self.max_tokens),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}"),
            (isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}"),
            (isinstance(self.skip_special_tokens, bool),
             f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}"),
            (self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, (list, tuple)) and self.allowed_token_ids
                                                and all(is_integer(t) for t in self.allowed_token_ids)),
             f"allowed_token_ids must be None or a non-empty list of token ids, got {reprlib.repr(self.allowed_token_ids)}"),
            (_finite_number(self.temperature) and self.temperature == 0,
             f"temperature must be 0: nanopaged's beam search ranks beams by the model's own "
             f"log-probabilities, got {self.temperature!r}"),
            (_finite_number(self.length_penalty),
             f"length_penalty must be a finite number, got {self.length_penalty!r}"),
        ]
        _refuse_the_first_failed(checks)
        self.beam_width, self.length_penalty = int(self.beam_width), float(self.length_penalty)
        self.max_tokens = None if self.max_tokens is None else int(self.max_tokens)


def stop_token_set(p: SamplingParams, eos_token_ids) -> set[int]:
    """The token ids whose draw ends a request: EOS (unless ignore_eos) and stop_token_ids."""
    return set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))


# -----------------------------------------------------------------------------
# Block and window arithmetic


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (vLLM's name): the blocks that hold a tokens, b to a block."""
    return -(-a // b)


def first_visible(position: int, window: int | None) -> int:
    """The first position the query at `position` sees: 0 without a sliding window, else
    the window's `window` positions end at its own (HF's masks)."""
    return 0 if window is None else max(position - window + 1, 0)


# -----------------------------------------------------------------------------
# Sequence: a request's state


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"     # preempted by swapping: its blocks wait in CPU memory
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, block_table, sample_index: int = 0, priority: int = 0):
        self.request_id = request_id
        self.sample_index = sample_index        # which of the request's n samples this is
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival                  # arrival order: the FCFS key (forks share it)
        self.priority = priority                # lower goes first, before arrival (vLLM's; 0 for all: FCFS)
        self.status = Status.WAITING
        self.finish_reason: str | None = None   # "stop", "length", "repetition", "abort", "error", or "dropped":
                                                # a beam that fell out of its beam search
        self.error: str | None = None           # with "error": why (the engine's words)
        self.num_computed_tokens = 0            # tokens computed: K/V written or found in the prefix
                                                # cache (under a window, also those before it, dropped)
        self.num_cached_tokens = 0              # prompt tokens not computed thanks to the prefix cache
                                                # (under a window, those before the window too)
        self.num_preemptions = 0                # times it was preempted (recomputed or swapped)
        self.num_seats = 1                      # seats of max_num_seqs granted when it was last admitted
                                                # (Scheduler._grant): with n samples pending, how many
                                                # run on once it forks, at least (Scheduler._defer)
        self.block_table = block_table
        self.root_hash = ROOT_HASH              # its first block's parent hash (root_hash: its cache_salt's)
        self.block_hashes: list[int] = []       # prefix hash of each full block hashed so far: a memo
                                                # (Scheduler._prefix_hashes), true for good since the
                                                # tokens only grow; kept through preemption
        self.token_counts = None                # its tokens counted for the penalties (nanopaged's
                                                # TokenCounts), from its first step that needs them
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def pending_samples(self) -> int:
        """n for a request's first sequence until its first token (then it forks into n), else 1."""
        return self.params.n if self.sample_index == 0 and self.num_output_tokens == 0 else 1

    @property
    def parked(self) -> bool:
        """Running with nothing left to compute: a beam that has its candidates and waits for
        its siblings' (LLM._beam_step). The scheduler skips it; preempted, it is recomputed."""
        return self.status is Status.RUNNING and self.num_computed_tokens == self.num_tokens

    @property
    def rank(self) -> tuple[int, int]:
        """Who goes first, request by request: the lower priority, then the earlier arrival.
        Every queue below is kept in this order (by `order`, which adds the sample index: a
        request's samples share its rank), the running sequences included, so the last
        running is the preemption victim and the head of the waiting queue is admitted next.
        With every priority 0 (vLLM's FCFS policy) this is first come, first served."""
        return (self.priority, self.arrival)

    @property
    def order(self):
        return (*self.rank, self.sample_index)

    def __repr__(self):
        return f"seq {self.request_id}.{self.sample_index}" if self.params.n > 1 else f"seq {self.request_id}"


def in_order(queue, seq: Sequence):
    """Put seq in its place in one of the scheduler's queues (waiting, running, swapped),
    each kept by Sequence.order: a queue's head goes first, and the running queue's tail is
    the preemption victim."""
    bisect.insort(queue, seq, key=lambda s: s.order)


# -----------------------------------------------------------------------------
# Prefix hashing
#
# A full block's hash covers the block's tokens *and* everything before it, by chaining:
# hash(parent block's hash, this block's token ids). Two requests get the same hash for
# block i exactly when their first (i+1) * block_size tokens and their cache_salt (where the
# chain starts: root_hash) agree (barring a collision, which BlockPool.lookup catches by
# comparing token ids). hashlib, not Python's hash(), so the same prefix gets the same hash in
# every run and process.

ROOT_HASH = 0


def root_hash(cache_salt: str | None) -> int:
    """The parent hash of a sequence's first block: ROOT_HASH, or with a cache_salt (vLLM's; "": none),
    the salt's own hash, which every block hash after it chains: only prompts of the same
    salt share blocks in the prefix cache, so that one tenant cannot learn, by timing its
    cache hits, what another's prompts began with."""
    if not cache_salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()[:8], "little")


def hash_block(parent_hash: int, token_ids) -> int:
    """A block's prefix hash: sha256 of (its parent's hash, its token ids), cut to 64 bits."""
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


# -----------------------------------------------------------------------------
# The scheduler


@dataclass
class SchedulerOutput:
    """One step's work: which sequences run, how many tokens each, and where they go."""
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)   # tokens computed for each sequence
    slots: list[list[int]] = field(default_factory=list)  # their cache slots (the slot_mapping)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)   # step 1's victims (recomputed or swapped
    # out): memory is short, so the step admits nobody (not listed: a parked beam preempted in step 2,
    # and _preempt_outranked's victims, who make room for the admission that follows)
    # swapping, to run before the copies: (GPU block, CPU block) pairs to save, then (CPU
    # block, GPU block) pairs to bring back; and the sequences that moved either way
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    # does sequence i reach its last token this step, so that its logits get sampled? (vLLM's
    # do_sample: False for a prefill chunk that ends before the prompt does)
    do_sample: list[bool] = field(default_factory=list)


class Admission(NamedTuple):
    """What admitting a sequence not running would take (Scheduler._admission)."""
    hits: list[int]   # the blocks that hold its K/V already (prefix cache, or its own, still here):
                      # its first ones, or under a window those from block `skip` on
    computed: int     # the tokens not computed again: those the hits hold and the skipped blocks'
                      # (or, swapped out, those it computed)
    skip: int         # the blocks before its window: dropped from the start, never taken
    num_new: int      # the tokens it computes this step (a chunk of its prompt, where the budget is short)
    short: int        # the blocks it lacks: it fits where short <= 0


class Scheduler:
    def __init__(self, pool, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 2048, enable_prefix_caching: bool = True,
                 eos_token_ids=(), swap_pool=None, sliding_window: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.eos_token_ids = set(eos_token_ids)
        self.swap_pool = swap_pool   # a BlockPool in CPU memory to preempt into; None: recompute only
        # Every layer's sliding window, if every layer has one: a sequence's blocks that slid
        # out of it are freed before each of its steps (_slide). None: blocks are kept to the end.
        self.sliding_window = sliding_window
        # Under the window a sequence holds the window and a step's chunk at most (blocks_at_most).
        # Where the pool cannot hold that for a whole budget's chunk, the budget shrinks to the
        # longest chunk it can (that bound solved for B): a request longer than the pool is then
        # served in smaller steps, not refused. (Window 8, 8 blocks of 4, budget 1024: for a
        # 10-token prompt with max_tokens 40 the bound is 13 blocks, more than the pool, though it
        # never holds more than 8; with the budget lowered to 18, the bound is 8, and it runs.)
        # A pool that cannot hold even a one-token chunk's window keeps the budget: only requests
        # that fit it whole are served there, and a smaller budget would only slow them.
        if sliding_window is not None:
            fits = (pool.num_blocks - 2) * self.block_size + 2 - sliding_window
            if fits >= 1:
                self.max_num_batched_tokens = min(max_num_batched_tokens, fits)
        # Every queue is kept in arrival order, or under priorities in Sequence.rank's (priority,
        # then arrival): "older" and "newer" below mean ahead of and behind in that order.
        self.waiting: deque[Sequence] = deque()  # in order (preempted ones go back in their place)
        self.swapped: deque[Sequence] = deque()  # swapped out, in order
        # From schedule() to update() or rollback(): the full blocks that this step's sequences
        # will have computed by the time attention reads them, prefix hash -> (block, token ids),
        # shared with sequences admitted later in the same step (see _place)
        self.in_flight: dict[int, tuple[int, tuple]] = {}
        # The step schedule() planned, until update() records it or rollback() undoes it
        self.scheduled: SchedulerOutput | None = None
        self.running: list[Sequence] = []        # in order (the preemption victim is the last)
        self.requests: dict[object, list[Sequence]] = {}  # request id -> its unfinished sequences
        self.next_sample_index: dict[object, int] = {}     # request id -> the index its next fork gets
        self.next_arrival = 0
        # counters for the engine's metrics
        self.num_preemptions = 0
        self.num_swapped_out = 0   # of those, by swapping
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # --- requests in and out ---
    def add(self, request_id, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
            cache_salt: str | None = None) -> Sequence:
        """Queue a request, in its place by priority (lower first) and then arrival: ahead of
        waiting requests of a higher priority value. Refuses, with a clear error, one that
        could never run. cache_salt: see root_hash."""
        check_priority(priority)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None:
            raise ValueError("max_tokens=None (up to the context) is resolved by LLM: give the scheduler a number")
        n_prompt, total = len(prompt_token_ids), len(prompt_token_ids) + params.max_tokens
        if n_prompt == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if params.beam and params.n > self.max_num_seqs:   # (its beams run together: n seats; samples wait, _defer)
            raise ValueError(f"beam_width = {params.n} exceeds max_num_seqs = {self.max_num_seqs}")
        if total > self.max_model_len:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context served, max_model_len = {self.max_model_len} tokens")
        blocks = self.blocks_at_most(total)
        # A beam search's beams must fit the pool all at once: a beam preempted and recomputed
        # apart from its siblings shares no partial block with them, and they wait for it (parked)
        if params.beam and params.n * blocks > self.pool.num_blocks:
            raise ValueError(f"beam_width = {params.n} beams of prompt + max_tokens ({total} tokens) need up "
                             f"to {params.n * blocks} KV blocks, but the whole pool has {self.pool.num_blocks}")
        if blocks > self.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens ({total} tokens) needs {blocks} KV blocks, but the "
                             f"whole pool has {self.pool.num_blocks}")
        seq = Sequence(request_id, prompt_token_ids, params, self.next_arrival, self.pool.new_table(),
                       priority=priority)
        seq.root_hash = root_hash(cache_salt)
        self.next_arrival += 1
        in_order(self.waiting, seq)   # (the tail, but for a lower priority value)
        self.requests[request_id] = [seq]
        self.next_sample_index[request_id] = 1
        return seq

    def blocks_at_most(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once: one per block_size
        tokens. Under a sliding window W with a token budget B, a step's chunk (up to B tokens)
        and the W - 1 positions its first query sees before it: W + B - 1 positions, which,
        starting anywhere in a block, lie in at most (W + B - 3) // block_size + 2 blocks; and
        one more for a copy-on-write. (That one is a safe margin, not needed: the oldest
        sequence, the one the pool must hold, never needs a copy-on-write to fit, since the
        only partial block it shares is a fork's, and its sharers, newer, are preempted
        first, see _make_room.) A request must fit the whole pool in this sense (add); B is
        lowered where the pool is too small for a whole one (__init__)."""
        blocks = cdiv(num_tokens, self.block_size)
        if self.sliding_window is not None:
            blocks = min(blocks, (self.sliding_window + self.max_num_batched_tokens - 3) // self.block_size + 3)
        return blocks

    def abort(self, request_id):
        """Stop a request now, wherever it is; its blocks return to the pool at once."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {reprlib.repr(request_id)}")
        for seq in list(self.requests[request_id]):
            self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str):
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)   # (its table is in the swap space: release() frees CPU blocks)
        else:
            return
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, time.perf_counter()
        # Full blocks that were registered stay in the prefix cache (ref_count 0, evictable).
        where = "CPU blocks" if seq.block_table.pool is self.swap_pool else "blocks"
        table = seq.block_table
        self.pool.say(f"{seq} finished ({reason}): releases {where} {table.block_ids[table.num_dropped:]}")
        seq.block_table.release()
        siblings = self.requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self.requests[seq.request_id], self.next_sample_index[seq.request_id]

    def fail_all(self) -> list:
        """The last resort after the engine's bookkeeping raised halfway (LLM._bookkeeping):
        every unfinished request ends with finish_reason "error" and is forgotten, whatever
        queue its sequences were in (or none); the engine then clears the pools, which no
        sequence holds any more. Returns their ids."""
        now = time.perf_counter()
        for seqs in self.requests.values():
            for seq in seqs:
                seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, "error", now
        failed = list(self.requests)
        for queue in (self.requests, self.next_sample_index, self.waiting, self.running, self.swapped):
            queue.clear()
        self.scheduled, self.in_flight = None, {}
        return failed

    def reset_counters(self):
        self.num_preemptions = self.num_swapped_out = self.prefix_hit_tokens = self.prefix_query_tokens = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step ---
    def schedule(self) -> SchedulerOutput:
        """One step's work, within the token budget and max_num_seqs: 0. under a sliding window,
        free what slid out; 1. the running sequences, oldest first (a decode token or the next
        prefill chunk), preempting the last in rank (first come, first served: the newest) where
        the pool runs short; 2. then, if none was preempted, waiting and swapped sequences, in
        order, as long as they fit."""
        # A step that was neither recorded nor undone (its rollback never ran: a second Ctrl-C
        # came as the first unwound, before the engine held Ctrl-C for it) left slots reserved
        # that hold nothing: undo it now, or every K/V its sequences write from here on would
        # land one slot off.
        self.rollback()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.in_flight = {}
        # 0. Under a sliding window, what slid out of every running sequence's window is freed
        #    first: a preemption below then never evicts a sequence for blocks nobody reads.
        for seq in self.running:
            self._slide(seq)
        #    Under priorities, a request that is next to run but does not fit takes the blocks
        #    of running requests of a worse priority (_preempt_outranked).
        self._preempt_outranked()
        # 1. Running sequences first, oldest first: a decode token, or the next prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.parked:
                i += 1
                continue
            # chunked prefill: a prompt longer than the budget left runs this much now, the rest next step
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                break  # seq preempted itself: it was the newest, nothing after it is left
            self._place(seq, n, out)
            budget -= n
            i += 1
        # 2. Then the sequences not running, in order, as long as they fit (no
        #    overtaking): waiting ones are admitted (prefilled, or recomputed), swapped-out
        #    ones come back (their blocks the prefix cache no longer holds copied back from
        #    CPU memory, nothing recomputed).
        #    After a preemption in step 1 memory is short: admitting more would only thrash.
        #    (So no step swaps both ways: swap-outs happen in step 1 alone. A parked beam
        #    preempted below, to make room, is recomputed, never swapped.)
        # The seats of max_num_seqs the running sequences hold, by holder (_seats): a request
        # with n samples that has not forked yet will soon be several sequences, so it holds the
        # seats it was granted for them (_grant: as many as were free, at least one; the rest
        # wait, _defer); a beam search holds beam_width while any of its beams runs.
        seats = dict(self._seats(s) for s in self.running)
        taken = sum(seats.values())
        # The room to grow that the running sequences of older requests need (_room_to_grow),
        # summed as the candidates advance in order: self.running is in that order too,
        # so its first `older` entries are the ones older than the candidate, each summed once.
        older = room = 0
        while (self.waiting or self.swapped) and budget > 0 and not out.preempted:
            from_swap, seq = self._next_to_admit()
            while older < len(self.running) and self.running[older].rank < seq.rank:
                room += self._room_to_grow(self.running[older])
                older += 1
            seated = self._grant(seq, taken)
            admit = self._admission(seq, from_swap, budget, room, seated)
            holder, wanted = self._seats(seq, seated)
            if holder in seats:   # (a beam of a search that runs: its seat is held already)
                wanted = 0
            if admit.short > 0 or taken + wanted > self.max_num_seqs:
                # A parked beam makes no progress until its siblings run: it must not hold
                # blocks or a seat that an older sequence waits for, or the two could wait for
                # each other for good. The newest such beam goes (recomputed later), and seq
                # is tried again.
                victim = self._parked_beam_newer_than(seq)
                if victim is None:
                    break
                self._preempt_by_recompute(victim)
                holder = self._seats(victim)[0]   # (its search holds on while another of its beams runs)
                if holder is victim or not any(s.status is Status.RUNNING for s in self.requests[victim.request_id]):
                    taken -= seats.pop(holder)
                continue
            if from_swap:
                self.swapped.popleft()
                self._swap_in(seq, admit.hits, out)
            else:
                self.waiting.popleft()
                self._adopt_cached_prefix(seq, admit.hits, admit.computed // self.block_size, admit.skip)
                seq.status = Status.RUNNING
                in_order(self.running, seq)
            seq.num_seats = seated
            self._place(seq, admit.num_new, out)
            budget -= admit.num_new
            seats.setdefault(holder, wanted)
            taken += wanted
        out.copies = self.pool.pending_copies
        self.pool.pending_copies = []
        self.scheduled = out
        return out

    def _next_to_admit(self) -> tuple[bool, Sequence]:
        """(whether it is swapped out, the sequence): the first in order of the waiting and
        swapped-out ones."""
        from_swap = bool(self.swapped) and (not self.waiting or self.swapped[0].order < self.waiting[0].order)
        return from_swap, self.swapped[0] if from_swap else self.waiting[0]

    def _admission(self, seq: Sequence, from_swap: bool, budget: int, room: int, seated: int) -> Admission:
        """What admitting seq, the next sequence not running, would take (Admission: its hits,
        the tokens they hold, the blocks it skips, its tokens this step, and the blocks it
        lacks). budget: the step's tokens left; room: the room to grow that the running
        sequences of older requests need (_room_to_grow), kept free for them; seated: how many
        of its samples will run once it samples (_grant)."""
        if from_swap:   # (its computed tokens are in the swap space, or still here: hits)
            # (Nothing of it slid out of its window while it was away: step 0 slid it just
            # before step 1 swapped it out, and it has computed nothing since.)
            hits, skip = self._still_cached(seq), 0
            computed = seq.num_computed_tokens
        else:   # (under a sliding window, the blocks before its window are not taken)
            hits, computed_blocks, skip = self._cached_prefix(seq)
            computed = computed_blocks * self.block_size
        n = min(seq.num_tokens - computed, budget)   # (chunked prefill: the first chunk, where the budget is short)
        covered = seq.block_table.num_dropped + skip + len(hits)   # (entries that need no new block)
        # A waiting prompt is admitted only when all of it fits, not just this step's chunk
        # (a swapped-out sequence comes back by its chunk: swapped out again, it loses none):
        # admitted on its first chunk, a long prompt is the newest running sequence,
        # the first preempted when the others grow, and recomputing it throws its
        # chunks away, again and again. (4 prompts of 2k-8k tokens in 600 blocks
        # of 16, no prefix cache: admitted by the chunk, 66,522 tokens computed;
        # admitted whole, the 20,256 that suffice. vLLM's v0 checked the whole
        # prompt too; its v1 checks the chunk.)
        # Not under a sliding window: there a prompt holds its window and a chunk
        # at most, and that bound (blocks_at_most: a whole budget's chunk, any
        # alignment) is loose enough to keep waiting requests that would have run
        # side by side: 4 prompts of 200 tokens, window 16, 34 blocks of 4 took
        # 106 steps instead of 62, none preempted either way.
        end = seq.num_tokens if not from_swap and self.sliding_window is None else computed + n
        need = cdiv(end, self.block_size) - covered
        revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)  # cached blocks we'd take
        # (and, while older requests run, room for them to grow and a block for seq to grow
        # into, one per sample that will run, `seated` (_grant): see _room_to_grow; room is 0
        # only when no older request runs)
        short = need + (room + seated if room else 0) - (self.pool.num_available - revived)
        return Admission(hits, computed, skip, n, short)

    def _preempt_outranked(self):
        """Under priorities: while the next sequence to admit would not be admitted this step,
        preempt the newest running sequence of a worse priority (a higher value), where
        preempting all of those would let it in (else they run on: nothing would be gained).
        Without this, a request of a better priority, admitted only when all of its prompt
        fits (_admission), would wait for the running requests of a worse one to finish,
        however long they generate. Memory, a seat of max_num_seqs and the step's token
        budget all count, as in vLLM's v0, which preempted for a waiting request so (its v1
        admits by chunks, and preempts by priority when a running request cannot grow).
        They are recomputed, never swapped: a swap-out would keep this step from admitting
        anyone (no step swaps both ways). No cycle: a sequence is only ever preempted for one
        of a strictly better priority."""
        while self.running and (self.waiting or self.swapped):
            from_swap, seq = self._next_to_admit()
            if self.running[-1].priority <= seq.priority:   # (running is in order: the last is the worst)
                return
            betters = [q for q in self.running if q.priority <= seq.priority]
            # (a request of n samples asks for the seats that preempting the worse ones would
            # free, as many as its samples: they are all its to take, and taken one a step it
            # would send its samples back to be recomputed as it forks, _defer)
            seated = self._grant(seq, sum(dict(self._seats(q) for q in betters).values()))
            if (self._admissible(seq, from_swap, self.running, seated)
                    or not self._admissible(seq, from_swap, betters, seated)):
                return
            victim = self.running[-1]
            self.pool.say(f"{seq} (priority {seq.priority}) cannot be admitted: {victim} (priority "
                          f"{victim.priority}) makes room")
            self._preempt_by_recompute(victim)

    def _admissible(self, seq: Sequence, from_swap: bool, keep: list[Sequence], seated: int) -> bool:
        """Whether schedule() would admit seq (the next not running) this step with `seated` of
        its samples seated (_grant), were only `keep` (the running sequences, or the
        first of them) running, the rest preempted: once step 1 has placed each of them (their
        tokens out of the budget, their new blocks), seq fits in the blocks left (with room for
        the older ones to grow), the budget left and `seated` seats."""
        tokens = blocks = 0
        for q in keep:
            n = 0 if q.parked else min(q.num_tokens - q.num_computed_tokens, self.max_num_batched_tokens - tokens)
            tokens, blocks = tokens + n, blocks + q.block_table.blocks_needed(n)
        if tokens >= self.max_num_batched_tokens:
            return False
        room = sum(self._room_to_grow(q) for q in keep if q.rank < seq.rank)
        admit = self._admission(seq, from_swap, self.max_num_batched_tokens - tokens, room, seated)
        gone = self.running[len(keep):]
        seats = dict(self._seats(q) for q in keep)
        holder, wanted = self._seats(seq, seated)
        return (admit.short + blocks - self._blocks_freed_by(gone, admit.hits) <= 0
                and sum(seats.values()) + (0 if holder in seats else wanted) <= self.max_num_seqs)

    def _blocks_freed_by(self, seqs: list[Sequence], hits: list[int]) -> int:
        """The blocks that preempting all of seqs would free (or leave in the prefix cache,
        evictable): those no other sequence holds; not hits, which the sequence admitted for
        them takes back."""
        held = Counter(b for q in seqs for b in q.block_table.block_ids[q.block_table.num_dropped:])
        hit = set(hits)
        return sum(1 for b, k in held.items() if k == self.pool.ref_count[b] and b not in hit)

    def _place(self, seq: Sequence, n: int, out: SchedulerOutput):
        out.seqs.append(seq)
        out.num_scheduled_tokens.append(n)
        out.slots.append(seq.block_table.slots_for(n))
        out.do_sample.append(seq.num_computed_tokens + n == seq.num_tokens)
        if self.enable_prefix_caching:
            # The blocks this step fills can serve a sequence admitted after seq in this same
            # step: every attention layer writes the whole batch's K/V before it reads any, so
            # they are there when that sequence's queries look. (They enter the prefix cache
            # proper only in update(), once the step has happened; the hashes are taken here,
            # once, and update() reads them from seq.block_hashes.)
            first, end = seq.num_computed_tokens // self.block_size, (seq.num_computed_tokens + n) // self.block_size
            self._prefix_hashes(seq, end)
            self._offer_in_flight(seq, first, end)   # the blocks this step fills

    def _offer_in_flight(self, seq: Sequence, first: int, end: int):
        """Offer seq's full blocks first .. end - 1, which this step fills or copies back, to
        the sequences admitted after it in the step (by their hashes, in seq.block_hashes)."""
        for i in range(first, end):
            self.in_flight.setdefault(seq.block_hashes[i], (seq.block_table.block_ids[i], self._block_tokens(seq, i)))

    def _slide(self, seq: Sequence):
        """Sliding window: free seq's blocks before the window of its next query (at position
        num_computed_tokens: it sees from num_computed_tokens - window + 1 on). No later query
        looks further back. A long request then holds about (window + its step's chunk) /
        block_size blocks, however long it grows. Called for the running sequences (a swapped
        one was slid before it went; a waiting one starts with the blocks before its window
        dropped: _adopt_cached_prefix)."""
        if self.sliding_window is None:
            return
        dropped = seq.block_table.drop_before(first_visible(seq.num_computed_tokens, self.sliding_window))
        if dropped:
            self.pool.say(f"{seq}: blocks {dropped} slid out of the window of {self.sliding_window} tokens: freed")

    def _room_to_grow(self, q: Sequence) -> int:
        """The blocks a running sequence q needs to grow by one block more: one, or two where
        its last block is partial and shared (a fork's: copy-on-write gives it its own), and one
        more for each further sample of the n it is about to fork into that runs on (they share
        the prompt's blocks, but copy-on-write gives each its own last block). Nothing for the
        rest of its prompt: step 2 runs only when step 1 placed every running sequence whole
        (budget left over, nothing preempted), so q's slots reach its last token (and
        _admissible, which asks before step 1, adds step 1's blocks apart). A waiting prompt, or
        a swapped-out sequence coming back, is admitted only with this room left free for every
        running sequence of an older request, and a block of its own to grow into for each of
        its samples that will run (`seated`, _admission).
        Admitted into the last free blocks, it would be the newest running sequence when the
        older ones cross their next block boundary a few steps later: preempted, recomputed from
        zero, and admitted again into the same squeeze. (Scheduler-only runs of the engine's
        workload, 64 requests of 16-512 + 32-256 tokens in 300-800 blocks of 16: see the
        README's "Room to grow".) Only older requests count, and they are all running (the
        candidate is the oldest sequence not running), so they make progress; once they have
        finished, it is admitted as it would have been without this room: nothing waits for good
        (but under priorities, a request waits as long as requests of lower values keep coming,
        as in vLLM). Newer sequences give way to it, not it to them."""
        return q.block_table.blocks_needed(self.block_size) + self._samples_seated(q) - 1

    def _samples_seated(self, seq: Sequence) -> int:
        """How many of a running seq's samples run once it samples: for a request's first
        sequence until it forks, the seats it was granted when admitted (_grant: the others
        wait, see _defer), else 1."""
        return min(seq.pending_samples, seq.num_seats)

    def _grant(self, seq: Sequence, taken: int) -> int:
        """How many of seq's samples would run once it samples, were it admitted now, `taken`
        seats of max_num_seqs being held. For a request's first sequence until it forks into n
        samples: one per free seat, n at most, and at least one. So it is admitted as soon as a
        seat is free, as vLLM V1 admits one by one the n requests of one sample it makes of it;
        the samples left without a seat wait at the fork (_defer), to be recomputed from the
        prefix cache as seats free. (Waiting for a seat for each sample instead, a request
        holds the head of the queue, and everything behind it, until nearly every running
        request has finished, with seats empty meanwhile: see the README's "Seats for
        samples".) Without the prefix cache (or where the request does not read it,
        skip_reading_prefix_cache), a sample that waits prefills its whole prompt again (32-87%
        more tokens in those workloads): there the request waits for a seat for each sample,
        max_num_seqs at most. A beam search's first beam: all beam_width beams, which run
        together (its search waits for beam_width seats, _seats). Any other sequence: 1."""
        if seq.params.beam is not None:
            return seq.pending_samples
        if not self.enable_prefix_caching or seq.params.skip_reading_prefix_cache:
            return min(seq.pending_samples, self.max_num_seqs)
        return max(1, min(seq.pending_samples, self.max_num_seqs - taken))

    def _seats(self, seq: Sequence, seated: int | None = None) -> tuple:
        """(who holds seq's seats of max_num_seqs, how many): seq itself, one seat, or for a
        request's first sequence until it forks into n samples, one per sample that will run
        then (_samples_seated; for one not running, `seated`, from _grant); or, for a beam,
        its search (the request id), beam_width seats while any of its beams runs.
        A search runs fewer beams where fewer candidates were left (allowed_token_ids, EOS ids
        among the best) and grows back to beam_width as it finds more, asking for no seat:
        were it to hold only its running beams' seats, a later request could take the others,
        and the search, growing back, would run past max_num_seqs."""
        if seq.params.beam is not None:
            return seq.request_id, seq.params.n
        return seq, self._samples_seated(seq) if seated is None else seated

    def _parked_beam_newer_than(self, seq: Sequence) -> Sequence | None:
        """The newest running beam that is parked (computed to its end, waiting for its
        siblings; see LLM._beam_step) and comes after seq in order (Sequence.order: a later
        request, one of a worse priority, or a later beam of seq's own search), if any."""
        for victim in reversed(self.running):
            if victim.order <= seq.order:
                return None
            if victim.parked:
                return victim
        return None

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until seq's n tokens fit. False if seq itself
        had to go. The oldest sequence always fits (add() checked that the most it holds at
        once, blocks_at_most, fits the whole pool), so it always makes progress: no livelock."""
        while seq.block_table.blocks_needed(n) > self.pool.num_available:
            victim = self.running[-1]
            out.preempted.append(victim)
            # Swap when there is swap space left, but not a parked beam (nothing left to compute:
            # brought back, it would be a step of no work): it is recomputed, to its candidates
            if (self.swap_pool is not None and self.swap_pool.num_free >= victim.block_table.num_held
                    and not victim.parked):
                self._swap_out(victim, out)
            else:
                self._preempt_by_recompute(victim)
            if victim is seq:
                return False
        return True

    def _move_table(self, seq: Sequence, pool, hits=()) -> list[tuple[int, int]]:
        """Give seq a table in pool (the swap space, or back) for the blocks it holds, which it
        releases: the blocks of pool in hits for its first ones (their K/V there already: see
        _still_cached), fresh ones for the rest. Returns the (old, new) block pairs whose data
        the engine copies. (Full blocks released here stay in the prefix cache, evictable.)
        Blocks that slid out of the window stay dropped: nothing to move."""
        old, new = seq.block_table, pool.new_table()
        new.skip_dropped(old.num_dropped)
        for block in hits:
            new.append_cached(block)
        kept = old.num_dropped + len(hits)
        new.append_moved(pool.allocate(len(old.block_ids) - kept), old.num_tokens)
        pairs = list(zip(old.block_ids[kept:], new.block_ids[kept:]))
        old.release()
        seq.block_table = new
        return pairs

    def _swap_out(self, seq: Sequence, out: SchedulerOutput):
        """Preemption by swapping: copy seq's blocks to CPU memory and free them here. It keeps
        everything it computed, and comes back (_swap_in) in its turn. Blocks it
        shared (forks) are copied for it alone: it comes back to share only those full blocks
        the prefix cache still holds."""
        self.running.remove(seq)
        pairs = self._move_table(seq, self.swap_pool)
        out.swap_out += pairs
        out.swapped_out.append(seq)
        self.pool.say(f"swap out {seq}: blocks {[a for a, _ in pairs]} -> CPU blocks {[b for _, b in pairs]}")
        seq.status = Status.SWAPPED
        in_order(self.swapped, seq)   # (the queue stays in order)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.num_swapped_out += 1

    def _swap_in(self, seq: Sequence, hits: list[int], out: SchedulerOutput):
        """Bring a swapped-out sequence back: its first blocks from the prefix cache, or from
        this step's blocks, where they hold its K/V already (hits, from _still_cached: nothing
        to copy), fresh blocks for the rest, its data copied into them. The CPU blocks are
        freed at once, before their copy runs: safe, because no step both swaps in and swaps
        out (swap-outs happen in schedule()'s step 1 alone, which then admits nothing more),
        so nothing writes to the swap space before the engine has read them."""
        pairs = self._move_table(seq, self.pool, hits)
        out.swap_in += pairs
        out.swapped_in.append(seq)
        self.pool.say(f"swap in {seq}: CPU blocks {[a for a, _ in pairs]} -> blocks {[b for _, b in pairs]}"
                      + (f"; blocks {hits} hold its K/V already (prefix cache, or this step's): not copied"
                         if hits else ""))
        # The full blocks copied back enter the prefix cache once the step has happened (in
        # update(), as in_flight blocks), and serve later sequences of this step already.
        # (Without the prefix cache no hash was taken: nothing to offer.)
        if self.enable_prefix_caching:
            first = seq.block_table.num_dropped + len(hits)
            self._offer_in_flight(seq, first, seq.num_computed_tokens // self.block_size)
        seq.status = Status.RUNNING
        in_order(self.running, seq)

    def _preempt_by_recompute(self, seq: Sequence):
        """Recompute preemption: drop all of seq's blocks at once and send it back to the
        waiting queue, in its place (mostly the head). Its prompt and the tokens it
        generated so far become its new prompt to prefill; with prefix caching on, its full
        blocks may still be found there."""
        self._send_back(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.pool.say(f"preempt {seq}: all its blocks freed, it will be recomputed "
                      f"({self.pool.num_available} blocks available)")

    def _defer(self, samples: list[Sequence]):
        """A request's samples just forked, more than the seats it was admitted with. The first
        ones run on in the seats of max_num_seqs free now: those it was granted (_grant), and
        any that others gave back since, this very update()'s finishes before it included (one
        later in it, or a stop string's, found after it, frees its seat for the next step). The
        others wait for a seat, each with its first token (drawn with its siblings' from the
        prompt's one row), sent back as a preempted sequence is, to be recomputed (with prefix
        caching on, from its prompt's cached blocks; off, its whole prompt again). vLLM V1
        makes n requests of one sample, each with its prompt. Not counted as a preemption: it
        never ran on its own."""
        # (Keeping only the seats granted would send back samples that a seat freed since takes
        # in the next step, at a recompute: 0.0-0.1% more tokens computed, the same steps, in
        # the README's "Seats for samples" workloads.) The seats held by every other request
        # leave its granted ones free at least: admissions since counted them.
        mine = set(samples)
        free = self.max_num_seqs - sum(dict(self._seats(q) for q in self.running if q not in mine).values())
        # (max: were none free, all wait; [-1:] would send back the last alone)
        for seq in [q for q in samples if q.status is Status.RUNNING][max(free, 0):]:
            self._send_back(seq)
            self.pool.say(f"{seq} waits for a seat of max_num_seqs = {self.max_num_seqs}: "
                          f"it will be recomputed")

    def _send_back(self, seq: Sequence):
        """seq's blocks released, back to the waiting queue to be recomputed (_preempt_by_recompute, _defer)."""
        if seq.status is Status.SWAPPED:   # (undoing a swap-out whose copy may not have run)
            self.swapped.remove(seq)
            seq.block_table.release()
            seq.block_table = self.pool.new_table()
        else:
            self.running.remove(seq)
            seq.block_table.release()
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        # back in order: usually the head, being older than every waiting sequence; but a
        # rollback, a parked beam's preemption, _preempt_outranked or _defer may send back one
        # newer than some
        in_order(self.waiting, seq)

    # --- prefix caching ---
    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int, int]:
        """The cached blocks seq can start from: the largest d such that block d - 1 and every
        block before block d that the query at position d * block_size reads are cached.
        Returns (those blocks, d, skip). Without a window, the longest chain of cached blocks
        from its first (skip = 0).

        Under a sliding window, only the blocks from its next query's window on (from index
        skip) must be cached, and those before may be gone (they count as cached tokens all
        the same: they are not computed either): a long sequence's first blocks slid out of
        its window first, so they are evicted first, while the ones its window reads are
        still there. (The hashes depend on the tokens alone: a block's is known whether the
        blocks before it are cached or not; and _prefix_hashes keeps them, so a long head
        waiting under a window is hashed once, not every step.)

        Only blocks that end before the last token count, so at least one token is computed
        and yields logits. A request that scores its prompt takes only those that end by its
        prompt_logprob_start until it has sampled: a cached token is never computed, so it
        would have no logits to score. One with skip_reading_prefix_cache takes none."""
        found = []               # per full block: its cached block or None
        d, last_miss = 0, -1  # the most blocks seq can count as computed; the last block not cached
        end = seq.num_tokens - 1   # (the tokens the cache may serve)
        if seq.params.skip_reading_prefix_cache:
            end = 0
        elif seq.params.scores_prompt and seq.num_output_tokens == 0:
            end = min(end, seq.params.prompt_logprob_start or 0)
        if self.enable_prefix_caching:
            for i in range(end // self.block_size):
                found.append(self._find_cached(self._prefix_hashes(seq, i + 1)[i], self._block_tokens(seq, i)))
                if found[-1] is None:
                    last_miss = i
                    # (under a window the scan goes on: a later block's window may begin past
                    # this miss)
                    if self.sliding_window is None:
                        break   # (no later block can serve without this one)
                elif last_miss < first_visible((i + 1) * self.block_size, self.sliding_window) // self.block_size:
                    d = i + 1   # every block from the window of the query after block i on is here
        skip = first_visible(d * self.block_size, self.sliding_window) // self.block_size
        return found[skip:d], d, skip

    def _block_tokens(self, seq: Sequence, i: int) -> tuple:
        """The token ids of seq's full block i: what its prefix hash covers, with the hashes
        of the blocks before it."""
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _find_cached(self, prefix_hash: int, tokens: tuple) -> int | None:
        """The block holding this full block's K/V: in the prefix cache, or being computed (or
        copied back from the swap space) in this very step, by a sequence placed before."""
        block = self.pool.lookup(prefix_hash, tokens)
        if block is None and self.in_flight.get(prefix_hash, (None, None))[1] == tokens:
            block = self.in_flight[prefix_hash][0]
        return block

    def _still_cached(self, seq: Sequence) -> list[int]:
        """For a swapped-out seq: the blocks here that hold its leading full blocks' K/V
        (found by the prefix hashes it computed; from the first it has not dropped): its own,
        released when it was swapped out and not evicted since, or a sharer's, or blocks this
        step computes or copies back (_find_cached). Swapped in, it adopts them, and only the
        rest is copied back."""
        hits = []
        if self.enable_prefix_caching:
            for i in range(seq.block_table.num_dropped, seq.num_computed_tokens // self.block_size):
                block = self._find_cached(seq.block_hashes[i], self._block_tokens(seq, i))
                if block is None:
                    break
                hits.append(block)
        return hits

    def _adopt_cached_prefix(self, seq: Sequence, hits: list[int], computed_blocks: int, skip: int):
        """seq (waiting, holding no block) takes the cached blocks that start it (hits, the
        K/V of its blocks skip .. computed_blocks - 1; from _cached_prefix). Its first `skip` blocks lie
        before its window: they are dropped from the start, cached or not."""
        seq.block_table.skip_dropped(skip)
        for block in hits:
            seq.block_table.append_cached(block)
        seq.num_computed_tokens = computed_blocks * self.block_size
        # The hit rate is about prompts: a preempted sequence finding its own blocks again on
        # its way back, or a sample that waited for a seat (_defer) finding its request's, is
        # a recompute made cheaper: not counted.
        if self.enable_prefix_caching and seq.num_preemptions == 0 and seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
        if hits:
            computing = {block for block, _ in self.in_flight.values()}
            in_step = [b for b in hits if b in computing]
            self.pool.say(f"prefix-cache hit for {seq}: blocks {hits} ({seq.num_computed_tokens} tokens not "
                          f"recomputed{f'; the {skip} before its window not needed' if skip else ''}"
                          f"{f'; {in_step} are being computed in this step' if in_step else ''})")

    def _prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes, extended to cover its first num_blocks full blocks. A memo: a
        block's prefix hash depends on the tokens alone, and a sequence's tokens only grow,
        so each is hashed once, however often the sequence is looked up, waits or is
        preempted."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else seq.root_hash, self._block_tokens(seq, i)))
        return hashes

    def _register_full_blocks(self, seq: Sequence, first: int):
        """Enter the blocks from index first on that this step filled into the prefix cache
        (_place took their hashes)."""
        for i in range(first, seq.num_computed_tokens // self.block_size):
            self.pool.register(seq.block_table.block_ids[i], seq.block_hashes[i], self._block_tokens(seq, i))

    def rollback(self):
        """Undo the step schedule() planned, if update() has not recorded it: it failed
        (an exception in the model or the sampler, a KeyboardInterrupt). Its slots were
        reserved, and some maybe written, but the step never happened. Its sequences are
        preempted, and recomputed when they run again. Blocks the prefix cache already holds were all
        filled by steps that did complete, so it stays true."""
        out, self.scheduled = self.scheduled, None
        if out is None:
            return
        # Its swaps may not have been copied either: the sequences it swapped out or in are
        # recomputed too.
        for seq in sorted({*out.seqs, *out.swapped_out, *out.swapped_in}, key=lambda s: s.order):
            if seq.status is Status.SWAPPED:   # swapped out by this step: that preemption becomes
                seq.num_preemptions -= 1       # the recompute below, and is counted once
                self.num_preemptions -= 1
                self.num_swapped_out -= 1
            if seq.status in (Status.RUNNING, Status.SWAPPED):
                self._preempt_by_recompute(seq)
        self.in_flight = {}

    # --- after the step ---
    def update(self, out: SchedulerOutput, sampled: dict) -> dict:
        """Record the step: the scheduled tokens are now in the cache, and sampled[seq] lists
        the tokens picked for a sequence: one; or k > 1, where it forks (a request's first
        sampling with n > 1, a beam that several of the best candidates continue), token 0
        its own, token j its j-th child; or none, a beam that fell out of its search, dropped.
        Returns {sequence: its new children}. The step's commit point is where update()
        clears self.scheduled, just before it returns: until then rollback() preempts the
        step's sequences, which is sound for an update() cut short while it counts computed
        tokens (the prefix cache then holds only blocks that were computed), but not once it
        has forked and appended; so the engine holds Ctrl-C through it all (its counting,
        forking and appending raise nothing else)."""
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            if seq.status is Status.RUNNING:
                first = seq.num_computed_tokens // self.block_size   # the block this step began in
                seq.num_computed_tokens += n
                if self.enable_prefix_caching:
                    self._register_full_blocks(seq, first)
        # A block computed in the step whose sequence then failed (its logits broke) or was
        # aborted was not registered above; if a sequence that adopted it holds it, its K/V are
        # good: cache it.
        for h, (block, tokens) in self.in_flight.items():
            if self.pool.ref_count[block] > 0:
                self.pool.register(block, h, tokens)   # (a no-op where registered above)
        self.in_flight = {}
        forked = {}
        for seq, tokens in sampled.items():
            if seq.status is not Status.RUNNING:
                continue  # aborted during the step
            if not tokens:
                self.finish(seq, "dropped")
                continue
            if len(tokens) > 1:
                forked[seq] = self.fork(seq, len(tokens) - 1)
                for child, t in zip(forked[seq], tokens[1:]):
                    self._append(child, t)
            self._append(seq, tokens[0])
            if seq in forked and not seq.params.beam:
                self._defer([seq, *forked[seq]])
        self.scheduled = None   # recorded, all of it: nothing to roll back
        return forked

    def fork(self, seq: Sequence, k: int) -> list[Sequence]:
        """k more samples of seq, sharing all its blocks (copy-on-write splits them later),
        numbered after every sample index the request has used (a beam search forks again and
        again, and its dropped beams' indices are not reused)."""
        children, first = [], self.next_sample_index[seq.request_id]
        self.next_sample_index[seq.request_id] += k
        for j in range(k):
            child = Sequence(seq.request_id, [], seq.params, seq.arrival, seq.block_table.fork(),
                             sample_index=first + j, priority=seq.priority)
            child.token_ids, child.num_prompt_tokens = list(seq.token_ids), seq.num_prompt_tokens
            child.num_computed_tokens = seq.num_computed_tokens
            child.num_cached_tokens = seq.num_cached_tokens
            child.root_hash, child.block_hashes = seq.root_hash, list(seq.block_hashes)
            child.arrival_time, child.status = seq.arrival_time, Status.RUNNING
            child.first_token_time = seq.first_token_time   # (its tokens so far are its parent's)
            in_order(self.running, child)
            self.requests[seq.request_id].append(child)
            children.append(child)
        table = seq.block_table
        self.pool.say(f"fork {seq} into {k + 1} {'beams' if seq.params.beam else 'samples'} "
                      f"sharing blocks {table.block_ids[table.num_dropped:]}")
        return children

    def _append(self, seq: Sequence, token: int):
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        p = seq.params
        if token in stop_token_set(p, self.eos_token_ids):
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= p.max_tokens:   # (add() made prompt + max_tokens fit max_model_len)
            self.finish(seq, "length")
        elif (p.repetition_detection and seq.num_output_tokens >= p.min_tokens
              and p.repetition_detection.ends_in_a_loop(seq.output_token_ids)):
            self.finish(seq, "repetition")
