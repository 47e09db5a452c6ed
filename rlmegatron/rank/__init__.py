"""What runs inside a trainer rank: the policy rank (`policy_rank.PolicyRank`, the methods the driver calls) and the
parts it is made of: model building (`role_models`), the colocated rollout engine's lifecycle (`colocated_engine`),
the weight push to the engines (`weight_push`), and checkpoints and HF export (`checkpoints`)."""
