"""How shardtensor fits other libraries that inspect tensors (Hugging Face transformers first).

Each module here changes another library's behaviour for ShardedTensors only, and only where the
other library asks a question shardtensor can answer better than its default (see the module's
docstring for what and why). Importing shardtensor installs them; for code without ShardedTensors
nothing changes.
"""
