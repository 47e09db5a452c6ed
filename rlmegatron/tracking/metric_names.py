"""The metric names the trainer logs, following verl so dashboards and habits carry over.

actor/pg_loss, actor/kl_loss, actor/entropy, actor/grad_norm, actor/pg_clipfrac, actor/ppo_kl, actor/lr
critic/vf_loss, critic/vf_clipfrac, critic/grad_norm            (PPO with a critic)
critic/score/{mean,max,min}          reward-function scores per response
critic/rewards/{mean,max,min}        rewards after penalties (KL in reward, DAPO overlong)
critic/advantages/{mean,max,min}, critic/returns/mean, critic/values/mean
critic/reward_baseline/mean          ReMax: reward of the greedy response per prompt (not trained on)
response_length/{mean,max,min}, response_length/clip_ratio       clip_ratio: share hitting max length
prompt_length/{mean,max,min}
reward/errors, reward/timeouts       responses whose reward function raised (or returned no number) / ran past
                                     reward.timeout_s; summed over a step's dynamic-sampling rounds
reward/overlong_penalty/mean, reward/overlong_ratio              DAPO manager
reward/model_score/mean              reward.model: the model's score before reward.model.weight
reward/rule_score/mean               reward.model with the rule's scores combined in (rule_weight or a combiner)
                                     reward/* means are over every response a step scored (all its rounds)
timing_s/{gen,gen_baseline,reward,old_log_prob,ref,adv,update_actor,update_critic,update_weights,step}
perf/throughput                      tokens per second per GPU over the whole step
val/{data_source}/score/mean         validation, one per data source (val/ prefix)
val/reward/*                         the reward manager's metrics above over the whole validation set
training/epoch, training/global_step
"""

ACTOR = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac")
REWARD_SCORE_MEAN = "critic/score/mean"
REWARD_MEAN = "critic/rewards/mean"
RESPONSE_LENGTH = ("response_length/mean", "response_length/clip_ratio")
TIMING_PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")
TIMING = tuple(f"timing_s/{phase}" for phase in TIMING_PHASES)
THROUGHPUT = "perf/throughput"
VALIDATION_PREFIX = "val/"
