"""What every pipeline shares about a corpus row, below the corpus builder (pipelines.corpora) and everything that
reads its output: the tokenizer and its special tokens (`tokenizer`), a row's columns and Parquet schema (`rows`,
`IGNORE`), memory chunks and their names (`chunking`: `### <path> [chunk <k>]`), and the shards on disk with their
manifest (`shards`). It imports no other pipelines package."""
