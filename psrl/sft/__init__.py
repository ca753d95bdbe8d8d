"""Supervised fine-tuning (``psrl sft``) on the Megatron trainer, and the ReTool cold-start
demonstrations it learns from (``psrl data retool-demos``).

- ``data``: chat rows (``messages``) and ``psrl rollout`` trajectories -> token ids + loss masks
- ``run``: the training loop, checkpoints and the Hugging Face export
- ``demos``: ReTool demonstrations made by a scripted policy through the real rollout path
- ``stats``: accuracy and well-formed tool-call rate of a trajectories file
- ``cli``: argument parsing for the subcommands
"""
