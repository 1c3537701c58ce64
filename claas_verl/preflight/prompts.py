"""Every prompt a continual MOPD run reads must fit in ``mopd.train.max_prompt_length``: checked before Ray starts.

verl 0.9.1 tokenizes prompts in its agent loop, not in the dataset, so ``data.truncation: error`` no longer fires: a
text prompt longer than ``rollout.prompt_length`` is cut to its last tokens with only a log line
(``AgentLoopWorker._cap_text_prompt_length``). The student then samples, is trained and is distilled on a prompt
without its beginning (the chat header, the task statement) while every evaluation reads the whole prompt, so a
stage learns less than it should and nothing says why. (Found on the gym bundle: its ``palin`` prompts are 405-411
tokens and the recipe allowed 256; that stage learned a fraction of what the same math learns on whole prompts.)

The rows checked are the ones the run reads: each domain's first ``num_blocks x block_size`` training prompts and,
when the forgetting evaluation is on, its first ``mopd.eval.prompts`` held-out ones. Lengths are counted as verl's
agent loop counts them: the student tokenizer's chat template with the generation prompt (plus
``data.apply_chat_template_kwargs``).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def prompt_token_lengths(messages: list, tokenizer, template_kwargs: dict) -> list[int]:
    """Token count of each chat prompt (a list of ``{"role", "content"}`` dicts) as the agent loop renders it."""
    kwargs = {k: v for k, v in template_kwargs.items() if k not in ("tokenize", "return_dict", "return_tensors")}
    lengths = []
    for m in messages:
        text = tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=False, **kwargs)
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return lengths


def _first_prompts(name: str, path: str, key: str, rows: int) -> list:
    """The first ``rows`` prompts of the parquet file ``path`` (config key ``name``), column ``key``."""
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    if key not in columns:  # pyarrow's own error names neither the config key nor the fix
        raise ValueError(f"{name}={path} has no column {key!r} (data.prompt_key); its columns are {columns}: set "
                         "data.prompt_key to the column that holds the chat prompts, or write the file with a "
                         f"{key!r} column")
    return pq.read_table(path, columns=[key]).column(key).slice(0, rows).to_pylist()


def overlong_prompts(cfg: DictConfig, plan, mopd, tokenizer) -> list[tuple[str, int, int, int]]:
    """``(config key, prompts over the limit, prompts read, longest)`` for each prompt file of the plan with prompts
    over ``mopd.train.max_prompt_length`` among the rows the run reads."""
    limit = int(mopd.train.max_prompt_length)
    key = str(OmegaConf.select(cfg, "data.prompt_key", default="prompt"))
    template_kwargs = OmegaConf.to_container(
        OmegaConf.select(cfg, "data.apply_chat_template_kwargs", default=None) or OmegaConf.create({}))
    files = []
    for d in plan.order:
        spec = mopd.domains[d]
        files.append((f"mopd.domains.{d}.prompts", spec.prompts, plan.num_blocks[d] * mopd.block_size))
        if mopd.eval.enabled and spec.test_prompts:
            files.append((f"mopd.domains.{d}.test_prompts", spec.test_prompts, mopd.eval.prompts))
    found = []
    for name, path, rows in files:
        lengths = prompt_token_lengths(_first_prompts(name, str(path), key, rows), tokenizer, template_kwargs)
        over = sum(n > limit for n in lengths)
        if over:
            found.append((name, over, len(lengths), max(lengths)))
    return found


def check_prompt_lengths(cfg: DictConfig, plan, mopd) -> None:
    """Raise ``ValueError`` naming every prompt file with prompts over ``mopd.train.max_prompt_length`` and the fix."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(str(model.get("tokenizer_path") or mopd.student),
                                              trust_remote_code=bool(model.get("trust_remote_code", False)))
    found = overlong_prompts(cfg, plan, mopd, tokenizer)
    if found:
        limit = int(mopd.train.max_prompt_length)
        lines = [f"{name}: {over} of the {rows} prompts the run reads are longer than mopd.train.max_prompt_length="
                 f"{limit} (longest {longest} tokens with the chat template)" for name, over, rows, longest in found]
        raise ValueError(
            "prompts longer than the run allows; verl's agent loop would keep only their last "
            f"{limit} tokens:\n  " + "\n  ".join(lines)
            + f"\nset mopd.train.max_prompt_length={max(f[3] for f in found)} or more (it sizes data.max_prompt_length "
            "and rollout.prompt_length), or shorten those prompts")
