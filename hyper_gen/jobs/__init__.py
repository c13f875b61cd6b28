"""What every product part shares (floor 4, under the server, the benchmarks and the CLI): the
user-error types, the HF tokenizer, one batch of prompts completed, and the resumable JSONL runner.

They live here, not in ``cli``, so the benchmarks and the server can use them without importing
the command line above them. Importing it imports no framework.
"""
