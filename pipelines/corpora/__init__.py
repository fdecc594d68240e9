"""Corpora for the stage jobs, built on Ray Data (`jobs/build_corpus.py`).

Output rows (Parquet, `OUT/train`, `OUT/val`; schema `pipelines.format.rows.ROW_SCHEMA`):

    task              code_qa | doc_qa | needle | commit
    variant           direct | agentic (Q&A); single | multikey | multivalue | hop2 | hop3 (needle);
                      raw | hinted | imperative | planning (commit)
    kind              the question kind (defines, params, method_of, returns, raises, callers, constant, section,
                      definition), or direct | agentic for needles, or the commit's change type
    prompt, target    text; target ends before <|im_end|>, which the token columns append
    answer            the bare answer (targets may add `<read>chunk</read>` or a plan around it)
    memory            list<str>: memory chunks, each starting with `### <path> [chunk <k>]`
    source, unit      the --source name and the repository (train/val split unit)
    evidence          struct {path, start_line, end_line}: where the answer stands (path relative to the source):
                      Q&A: from the first to the last line of the question's subject and its answer (for a
                      method, its `class` line to its `def` line)
    evidence_chunks   list<str>: the memory chunks (`### <path> [chunk <k>]`) that hold those lines, in file order
                      (a method's `class` and `def` chunks, not the chunks between): the answer stands in their
                      text (a path in their headers); an agentic target reads each, in this order, then answers.
                      Needles: the chunks of the needles the answer needs (hops: along the chain); commits: the
                      changed file's chunks around the hunks
    depth             needles: where the asked needle sits (0 = first chunk, 1 = last); null otherwise
    memory_chunks, memory_tokens
    diff              commits: the unified diff (for evaluation); "" otherwise
    origin            commits: struct {repository (the git top level, absolute), commit, parent (shas)}, so the
                      commits suite can rebuild the parent tree and run its tests; null otherwise
    input_ids         list<int32>: prompt + target + <|im_end|>
    labels            list<int32>: -100 over the prompt, then the target ids
    memory_input_ids  list<list<int32>>: one unpadded token list per memory chunk (= tokenizer(memory[k]))

Shards hold row groups of at most `row_group_rows` rows; OUT/manifest.json lists every shard's bytes, rows, rows per
row group and sha256. The training job checks and reads them with pipelines.format.shards (each worker its own row
groups) and pads `input_ids`/`labels` and each memory chunk in its collate function.
"""
