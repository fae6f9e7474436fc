"""The `dlo` command line: the table of subcommands (`main`) and the node-cache commands.

Each plane's subcommand lives in that plane and is imported only when it runs; this package
imports nothing but the contract.
"""
