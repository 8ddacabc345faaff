"""The subcommands of `megatron-id`, one module each (cli.py puts them together).

Every module has `add_parser(sub)`, which declares its flags on cli.py's subparsers and sets
`func=run`, and `run(args) -> int`, the exit status. preprocess and kernel-resources hand the
rest of the line to a parser of their own: their `run` gets `args.argv` and `args.debug`.
options.py holds the flags and parsing that several commands share.

Imports that bring torch or DeepSpeed stay inside `run` (see cli.py): `megatron-id --help` and a
refused flag import every module here, and must not wait for them.
"""
