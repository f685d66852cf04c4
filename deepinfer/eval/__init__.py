"""Evaluation with generation and grading apart (`deepinfer eval generate | grade`).

tasks.py      the task format (a JSON spec + JSONL items) and the shipped tasks (eval/tasks/)
generate.py   clients (a server's OpenAI routes, or the in-process LLM) and the generation loop
runfile.py    the run file: appended per sample, resumed without redoing finished samples
grade.py      coverage, then graders (exact match, code in the sandbox) and the pass@k estimator
sandbox.py    one untrusted program per child process, with limits (sandbox_child.py is the child)
"""
