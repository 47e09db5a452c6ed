"""parity_reward for the first $RLM_NAN_AFTER calls, NaN after them: a reward bug that poisons the loss mid-run.
Calls are counted as files in $RLM_NAN_REWARD_DIR, which works whether rewards run in threads or processes."""
import math
import os
import tempfile

from tests.driver.parity_reward import compute_score as parity


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    directory = os.environ["RLM_NAN_REWARD_DIR"]
    os.close(tempfile.mkstemp(dir=directory)[0])
    if len(os.listdir(directory)) > int(os.environ["RLM_NAN_AFTER"]):
        return math.nan
    return parity(data_source, solution_str, ground_truth, extra_info)
