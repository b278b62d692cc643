"""Exercise 10.4: the prescriptions (lesson 10-clinic.md).

Three patients came in with a `nanoserve serve` command each (the lesson's patients A, B and C).
For each one, write what the diagnosis rests on and what you prescribe:

- evidence(mystery): the one number the diagnosis rests on, read off the lesson's runs:
  A: how many tokens the KV cache holds, as the refusal states it;
  B: the step at which the last of the 8 requests samples its first token (the trace);
  C: how many times the run preempted a request (the workload's report, or the trace);
- prescribe(mystery): the flags to change, as {Config field: new value} (Config's names:
  {"max_num_seqs": 8}, not "--max-num-seqs"). Change what is at fault and keep what the patient
  needs: A serves sequences of 512 tokens; the workloads stay as they are.

The check runs each setup as it came in, to check your evidence, and with your flags, to check
that the symptom is gone: A starts and serves 512 tokens; in B every request has its first token
no later than with the default flags; C runs without a preemption, in no more steps than the storm.
Check: `nanoserve exercise check 10.4`.
"""


def evidence(mystery: str) -> int:
    raise NotImplementedError("implement evidence in lessons/exercises/lesson10_clinic.py: the "
                              "number each diagnosis rests on, read off the lesson's runs")


def prescribe(mystery: str) -> dict:
    raise NotImplementedError("implement prescribe: the flags that fix each mystery, as "
                              "{Config field: new value}")
