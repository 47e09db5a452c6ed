"""Every field of the job spec, what it changes, and the tests that show it (or that a value it cannot honour is
rejected). tests/config/test_field_effects.py walks every leaf of `JobSpec` (dict fields such as megatron.extra are
leaves) and fails for one without an entry here: a new field lands with the test of its effect.

An entry is `field: (what it changes, test node ids)`, one per line, sorted by field. Where the spec value is only
handed to a mechanism (a worker, a loss, an engine), the entry names both the test that it is handed over and the
test of the mechanism. The long test ids are named once, below.
"""

# Spec -> role settings (tests/driver/test_role_settings.py), pure and in a policy rank built from a spec.
ROLES = "tests/driver/test_role_settings.py::"
ACTOR_SETTINGS = ROLES + "test_the_actor_settings_carry_every_actor_field"
CRITIC_SETTINGS = ROLES + "test_the_critic_settings_carry_every_critic_field_and_the_shared_loss_aggregation"
LAYOUT = ROLES + "test_the_actor_layout_is_the_spec_layout"
OFFLOAD = ROLES + "test_each_offload_field_offloads_its_part"
RANK_OFFLOAD = ROLES + "test_a_rank_built_from_the_spec_offloads_the_parts_each_role_asks_for"
RANK_OPTIMIZER = ROLES + "test_a_rank_built_from_the_spec_steps_with_its_optimizer_settings"
RANK_BATCHING = ROLES + "test_a_rank_built_from_the_spec_batches_its_updates_as_the_spec_says"
RANK_MODEL = ROLES + "test_a_rank_built_from_the_spec_has_its_dtype_seed_and_critic_init"

# Vision-language models (rlmegatron/models/vision.py).
VISION = "tests/models/test_qwen2_5_vl.py::"
QWEN3_VL = "tests/models/test_qwen3_vl.py::"
DEEPSTACK_SPLIT = (QWEN3_VL + "test_a_pipeline_split_that_takes_deepstack_layers_off_the_first_stage_is_refused_"
                   "before_any_rank_starts")
IMAGES = "tests/data/test_images.py::"

# Multi-turn rollouts (rlmegatron/agent).
AGENT_SETTINGS = ROLES + "test_the_multi_turn_section_reaches_the_engines_agent_loop"
AGENT_TOKENS = ("tests/agent/test_trajectories.py::"
                "test_a_conversation_with_several_tool_calls_is_the_sampled_tokens_and_the_rendered_answers")
AGENT_TURNS = "tests/agent/test_trajectories.py::test_max_turns_ends_a_trajectory_that_keeps_calling_and_a_long_answer_is_cut"
AGENT_CALLS = "tests/agent/test_tools.py::test_hermes_reads_every_call_of_a_turn_and_names_what_is_malformed"
TOOL_TIMEOUT = "tests/agent/test_tools.py::test_a_tool_that_raises_or_hangs_answers_with_an_error_message_instead"

# A rollout pool that grows and shrinks (rlmegatron/driver/pool_control.py).
POOL_CONTROL = "tests/driver/test_pool_control.py::"
ELASTIC = "tests/driver/test_elastic_pool.py::test_engines_join_and_leave_a_running_job_and_no_sample_is_lost"

# Multi-token prediction: trained with the policy, drafting in the engines (rlmegatron/models/mtp.py).
MTP_CHECKS = "tests/config/test_checks.py::test_mtp_training_and_drafting_need_a_checkpoint_that_holds_mtp_layers"
MTP_TRAINING = "tests/models/test_mtp_training.py::"
MTP_TRAINS = (MTP_TRAINING + "test_with_a_weight_the_mtp_loss_is_megatrons_over_the_response_and_its_gradient_trains_"
              "mtp_and_trunk")
MTP_OFF = MTP_TRAINING + "test_at_weight_zero_the_update_is_exactly_the_update_without_mtp_layers"
MTP_DETACHED = (MTP_TRAINING + "test_detached_the_mtp_loss_trains_the_mtp_layer_alone_and_the_policy_steps_as_"
                "without_it")
LOCAL_SPECULATIVE = "tests/rollout/test_speculative.py::"
LOCAL_SPECULATIVE_RUN = (LOCAL_SPECULATIVE + "test_a_count_up_run_drafts_with_the_trained_mtp_layer_and_samples_from_the_"
                         "policy")
LOCAL_SPECULATIVE_EXACT = (LOCAL_SPECULATIVE + "test_sampled_tokens_follow_the_main_models_distribution",
                           LOCAL_SPECULATIVE + "test_greedy_tokens_equal_plain_decoding_with_drafts_kept_and_rejected")
MTP_PLAN = "tests/planner/test_mtp_plan.py::test_the_mtp_layer_is_held_trained_and_synced_on_the_last_stage"
SPECULATIVE_PLAN = ("tests/planner/test_mtp_plan.py::"
                    "test_speculative_rollout_holds_the_draft_and_shortens_generation_by_the_assumed_acceptance")
SGLANG_SPECULATIVE = ("tests/rollout/test_sglang_speculative.py::"
                      "test_mtp_speculative_rollout_launches_sglang_drafting_k_tokens_with_the_checkpoints_mtp_layer")
SGLANG_DRAFT_NAMES = ("tests/rollout/test_sglang_speculative.py::"
                      "test_sglangs_draft_model_loads_its_mtp_layer_from_the_synced_names")

# On-policy distillation (algorithm.distill, the teacher role).
DISTILL = "tests/driver/test_distillation.py::"
DISTILL_ALONE = DISTILL + "test_distillation_alone_trains_on_minus_coef_times_the_reverse_kl_and_ignores_the_reward"
DISTILL_ADDED = (DISTILL + "test_distillation_adds_to_the_task_advantage_and_reads_the_old_log_probs_when_the_step_"
                 "has_them")
DISTILL_RUN = DISTILL + "test_the_quickstart_model_distilled_from_a_solved_run_reaches_0_8_in_fewer_steps_than_grpo"
DISTILL_BASELINE = ("tests/algorithms/test_distill.py::test_the_group_mean_baseline_takes_each_prompts_mean_term_over_"
                    "its_response_tokens_out")
DISTILL_SPEC = "tests/config/test_distill_spec.py::"
TEACHER_ROLE = DISTILL_SPEC + "test_the_teacher_role_is_laid_out_batched_and_offloaded_by_its_own_section"
TEACHER_REFUSALS = DISTILL_SPEC + "test_an_unknown_mode_a_critic_and_a_training_knob_of_the_teacher_are_refused"
TEACHER_ARCH = (DISTILL_SPEC + "test_the_teachers_architecture_comes_from_its_config_or_hf_config_and_its_layout_must_"
                "fit_it")
TEACHER_TOKENIZER = DISTILL_SPEC + "test_a_teacher_whose_tokenizer_is_not_the_students_is_refused_by_rlm_validate"
TEACHER_RANK = "tests/rank/test_teacher_rank.py::"
TEACHER_LOG_PROBS = (TEACHER_RANK + "test_the_teachers_log_probs_are_its_hf_models_at_every_layout_and_from_its_"
                     "converted_checkpoint")
TEACHER_BATCHING = TEACHER_RANK + "test_the_teacher_batches_and_offloads_as_its_section_says"

# Delta weight sync (rlmegatron/rollout/delta.py).
DELTA_SYNC = "tests/driver/test_delta_sync.py::"

# Trainer ranks restarted within the run (trainer.max_restarts).
RANK_RESTART = ("tests/driver/test_rank_restart.py::"
                "test_a_rank_killed_mid_update_is_restarted_and_the_run_ends_as_a_resume_from_its_checkpoint")
RANK_RESTART_LIMIT = ("tests/driver/test_rank_restart.py::"
                      "test_a_rank_that_dies_again_past_max_restarts_stops_the_run_with_one_line")

# The fit loop on the pure-Python rig (tests/driver/fit_rig.py).
FIT = "tests/driver/test_fit_loop_settings.py::"
SAMPLING = FIT + "test_rollout_sampling_settings_reach_every_request_and_the_batch"
RESPONSE_LENGTH = FIT + "test_max_new_tokens_follows_data_max_response_length"
VALIDATION = FIT + "test_validation_runs_when_and_how_the_spec_says"
SCHEDULE = FIT + "test_the_run_length_and_its_checkpoints_follow_the_trainer_section"
GAE = FIT + "test_gae_discounts_with_gamma_and_lam"
GRPO_STD = FIT + "test_grpo_divides_by_the_group_std_only_when_asked"
KL_IN_REWARD = FIT + "test_kl_in_the_reward_uses_its_estimator_and_controller"
DYNAMIC_SAMPLING = FIT + "test_dynamic_sampling_generates_up_to_its_round_limit"
ESTIMATORS = "tests/driver/test_algorithms_fit.py::test_estimator_runs_the_fit_loop"

# What `rlm train` hands to the data, reward, checkpoint and tokenizer parts.
JOB_WIRING = ("tests/driver/test_job_wiring.py::"
              "test_run_training_hands_the_data_reward_checkpoint_and_tokenizer_settings_over")

# Whole runs (tests/driver/test_train.py).
TRAIN = "tests/driver/test_train.py::"
IN_PROCESS = TRAIN + "test_the_policy_rank_runs_in_process_without_ray_on_a_model_with_its_own_code"
PROCESSES_RUN = TRAIN + "test_the_processes_transport_trains_on_two_rank_processes_without_ray"
TRANSPORT_AUTO = "tests/driver/test_job_wiring.py::test_auto_launches_processes_where_the_run_fits_one_machine_without_ray"
RAY_LOOP = TRAIN + "test_the_loop_logs_finite_verl_metrics_on_two_ray_ranks"
RESUME = TRAIN + "test_resume_gives_the_same_next_step_metrics"
SIGTERM = TRAIN + "test_sigterm_stops_every_rank_and_engine_server_and_keeps_the_last_checkpoint"
DAPO_RUN = TRAIN + "test_dapo_runs_in_process"
PPO_RUN = TRAIN + "test_ppo_with_critic_trains_the_same_with_every_role_offloaded_between_phases"
NAN_RUN = TRAIN + "test_a_nan_stops_the_step_keeps_the_last_checkpoint_and_says_why"
ROUTED_RUN = TRAIN + "test_disaggregated_engine_behind_a_router_gets_weights_over_its_group_and_a_restarted_one_rejoins"
GSM8K = "tests/driver/test_gsm8k_smoke.py::test_three_grpo_steps_on_real_gsm8k"
QUIET_RUN = ("tests/driver/test_run_dir.py::"
             "test_a_run_prints_one_line_a_step_and_a_table_every_log_freq_steps_and_no_library_warning")

# Engines and servers.
ENGINES = "tests/driver/test_engine_fleet.py::"
COLOCATED_SERVER = ENGINES + "test_a_colocated_server_spans_two_nodes_gets_each_ranks_buckets_and_restarts_whole"
DISAGGREGATED_SERVER = ENGINES + "test_a_disaggregated_server_spans_two_nodes_and_restarts_every_node"
SERVER_DTYPE = ENGINES + "test_the_server_command_serves_model_dtype"
BUCKETS_AND_ROUTER = ENGINES + "test_a_spec_built_engine_sends_buckets_of_the_spec_size_and_joins_the_routers_it_names"
STARTUP_TIMEOUT = ENGINES + "test_a_server_slower_than_the_startup_timeout_fails_the_start_and_is_stopped"
ENGINE_POOL = ENGINES + "test_rollout_num_gpus_sizes_the_engine_pool"
LAUNCH = "tests/rollout/test_sglang.py::test_launch_commands_follow_the_config"
LAUNCH_OFF = "tests/rollout/test_sglang.py::test_launch_commands_leave_out_what_the_config_turns_off"

# Mechanisms, tested with hand-built settings.
CLIPS = "tests/algorithms/test_policy_loss.py::test_ppo_dual_clip_clip_higher_by_hand"
ENTROPY_BONUS = "tests/algorithms/test_policy_loss.py::test_entropy_bonus_by_hand"
IS_WEIGHTS = "tests/algorithms/test_policy_loss.py::test_rollout_importance_weights_scale_each_tokens_loss_by_hand"
CORRECTION = "tests/algorithms/test_rollout_correction.py::"
IS_BY_HAND = CORRECTION + "test_importance_weights_by_hand"
RS_BY_HAND = CORRECTION + "test_rejection_by_hand"
VETO = CORRECTION + "test_the_veto_rejects_a_whole_sequence_for_one_token"
CORRECTION_FIT = FIT + "test_rollout_correction_weights_and_rejects_what_the_actor_trains_on"
OFF_POLICY = "tests/driver/test_off_policy_fit.py::"
ONE_STEP_OFF = OFF_POLICY + "test_one_step_off_generates_the_next_rollout_while_the_step_trains"
ASYNC_BOUND = OFF_POLICY + "test_async_runs_ahead_within_max_staleness"
MODE_ERRORS = OFF_POLICY + "test_combinations_that_cannot_run_are_spec_errors"
ASYNC_RUN = "tests/driver/test_async_train.py::test_async_trains_within_its_staleness_bound_and_logs_it"
PAUSED_PUSH = ("tests/driver/test_engine_fleet.py::"
               "test_a_push_pauses_the_servers_and_continues_them")
PARTIAL_SGLANG = "tests/rollout/test_sglang.py::test_partial_rollout_goes_on_from_the_paused_tokens_with_the_new_weights"
PARTIAL_LOCAL = ("tests/rollout/test_local_server.py::"
                 "test_partial_rollout_continues_under_the_new_weights_with_exact_log_probs")
KL_LOSS = "tests/algorithms/test_kl.py::test_kl_loss_by_hand"
KL_ESTIMATORS = "tests/algorithms/test_kl.py::test_estimators_by_hand"
AGGREGATION = "tests/algorithms/test_aggregation.py::test_modes_by_hand"
VALUE_CLIP = "tests/algorithms/test_value_loss.py::test_clipped_value_loss_by_hand"
ACTOR_PARITY = "tests/rank/roles/test_actor.py::test_log_probs_entropy_and_update_match_tp1"
REFERENCE = "tests/rank/roles/test_actor.py::test_reference_log_probs_equal_the_actors"
ROUND_TRIP = "tests/rank/roles/test_actor.py::test_offload_round_trip_keeps_training_identical"
CRITIC_WORKERS = "tests/rank/roles/test_critic_and_moe.py::"
MOE_EP2 = CRITIC_WORKERS + "test_moe_actor_trains_at_ep2_and_logs_router_aux_loss"
REWARD_MODEL_CRITIC = CRITIC_WORKERS + "test_critic_from_an_hf_reward_model_at_tp2_gives_its_values"
ETP_EXPORT = "tests/resharding/test_export.py::test_stream_is_bitwise_the_source_checkpoint_at_every_layout"
PARALLEL_PARITY = "tests/runtime/test_parallel_parity.py::"
SP_PARITY = PARALLEL_PARITY + "test_moe_ep2_allgather_ep2_alltoall_tp2_sequence_parallel_and_cp2xep2"
DATASET = "tests/data/test_dataset.py::"
CUSTOM_DATASET = DATASET + "test_custom_dataset_class_is_loaded_from_file_and_gets_the_same_arguments"
OVERLONG_DROPPED = DATASET + "test_overlong_prompts_are_dropped_and_counted"
OVERLONG_REJECTED = DATASET + "test_overlong_prompts_reject_the_dataset_unless_filtering"
PROMPT_KEY = DATASET + "test_the_prompt_is_read_from_data_prompt_key"
PLAIN_PROMPTS = DATASET + "test_plain_prompts_are_tokenized_as_they_are_with_data_prompt_format_plain"
ANSWER_KEY = DATASET + "test_the_ground_truth_is_read_from_data_answer_key"
SEEDED_ORDER = "tests/data/test_sampler.py::test_each_epoch_covers_the_data_once_in_a_new_order"
STORED_ORDER = "tests/data/test_sampler.py::test_iter_epoch_gives_the_rest_of_the_epoch_then_a_fresh_one"
REWARDS = "tests/rewards/test_managers.py::"
DAPO_PENALTY = REWARDS + "test_dapo_manager_adds_the_penalty_to_the_score"
DAPO_OFF = REWARDS + "test_dapo_without_the_buffer_enabled_is_naive"
PENALTY_FACTOR = REWARDS + "test_dapo_penalty_scales_with_the_penalty_factor"
REWARD_WORKERS = REWARDS + "test_reward_num_workers_score_side_by_side"
REWARD_TIMEOUT = REWARDS + "test_failures_score_zero_are_counted_and_logged_once_the_batch_goes_on"
TIMEOUT_FRACTION = REWARDS + "test_max_timeout_fraction_is_how_many_timeouts_a_batch_may_have"
TIMEOUT_STOPS_RUN = ("tests/driver/test_faults.py::"
                     "test_a_reward_stuck_in_c_code_stops_the_run_with_one_line_and_leaves_no_worker_running")
TRACKING = "tests/tracking/test_tracking.py::"
MLFLOW_STORE = TRACKING + "test_mlflow_sqlite_store_holds_params_metrics_and_the_resolved_yaml"
CONSOLE = TRACKING + "test_console_prints_one_line_a_step_and_the_full_table_every_log_freq_steps"
TRACKING_URI = TRACKING + "test_the_mlflow_store_is_the_specs_tracking_uri"
URI_ORDER = TRACKING + "test_tracking_uri_prefers_the_spec_then_the_environment_then_the_run_dir"
FILE_STORE = TRACKING + "test_an_mlflow_file_store_takes_the_runs_metrics"
BACKENDS = "tests/tracking/test_backends.py::"
EVERY_BACKEND = BACKENDS + "test_every_backend_gets_the_same_metric_names_values_and_samples"
RESUMED_BACKENDS = BACKENDS + "test_a_resumed_run_continues_its_wandb_and_tensorboard_runs"
MISSING_PACKAGE = BACKENDS + "test_a_backend_whose_package_is_missing_is_one_line_at_validation"
WANDB_ACCOUNT = BACKENDS + "test_wandb_without_an_account_outside_offline_mode_is_one_line"
RESUMED_RUN_BACKENDS = TRAIN + "test_after_the_resume_wandb_continues_its_run_and_tensorboard_shows_each_step_once"
TRAINER_POOL = "tests/transport/test_placement.py::test_each_node_gets_one_bundle_of_its_ranks_and_no_two_share_a_node"
MULTI_NODE = "tests/launch/test_local_cluster.py::test_the_quickstart_submitted_to_the_cluster_learns_with_its_ranks_on_two_nodes"
OWN_NODES = "tests/launch/test_local_cluster.py::test_the_rollout_pool_gets_a_node_of_its_own_and_an_engine_that_joins_gets_a_placement_group_and_the_weights"

# Rejections and checks.
CHECKS = "tests/config/test_checks.py::test_check_fires_with_field_value_and_fix"
HUB_ARCHITECTURE = CHECKS + "[tp-divides-heads]"
ROUNDS_BOUND = "tests/config/test_rejections.py::test_dynamic_sampling_needs_a_bound_on_its_rounds"
HUB_SNAPSHOT = "tests/entry/test_cli.py::test_train_runs_a_hub_model_from_its_downloaded_snapshot"

# Each role's own optimizer schedule and Megatron settings, layouts and batching.
OPTIMIZER = "tests/rank/roles/test_optimizer.py::"
LR_SCHEDULE = OPTIMIZER + "test_actor_lr_follows_the_closed_form_schedule"
LR_RESUMED = OPTIMIZER + "test_a_resumed_worker_continues_the_schedule_and_the_weights"
PLAIN_ADAM = OPTIMIZER + "test_plain_and_distributed_optimizer_step_the_same_at_dp2"
RECOMPUTE = "tests/models/test_recompute.py::test_recompute_keeps_loss_and_gradients_and_saves_fewer_activations"
TO_TRANSFORMER_CONFIG = "tests/models/test_hf_config.py::test_spec_recompute_and_extra_reach_the_transformer_config"
UNEVEN_PIPELINE = "tests/runtime/test_parallel_parity.py::test_dense_tp2_pp2_vpp2_tp2xpp2_and_cp2_on_4_ranks"
DEEPSEEK_SPLIT = ("tests/test_recipes.py::"
                  "test_deepseek_v3_recipe_builds_the_uneven_pipeline_that_its_checks_and_plan_use")
POLICY_RANK = "tests/rank/test_policy_rank.py::"
OWN_LAYOUTS = POLICY_RANK + "test_reference_and_critic_at_their_own_layouts_equal_the_actor_layout_run"
OWN_CHECKPOINTS = POLICY_RANK + "test_each_role_saves_and_restores_its_checkpoint_at_its_layout"
REF_BATCHING = POLICY_RANK + "test_the_reference_batches_its_forward_by_its_own_settings"
CP_ROLES = POLICY_RANK + "test_every_role_at_context_parallel_2_equals_the_run_without"
CP_CRITIC = CRITIC_WORKERS + "test_critic_values_at_cp2_equal_cp1"
CP_TOKEN_BUDGET = ROLES + "test_a_per_gpu_token_budget_holds_the_tokens_of_every_context_parallel_rank"
MOE_REFERENCE = CRITIC_WORKERS + "test_moe_reference_at_ep4_beside_an_ep2_actor_gives_the_actors_log_probs"
NEVER_TRAINS = "tests/config/test_relevance.py::test_a_setting_that_would_change_nothing_is_rejected"
REMOTE_CODE = ("tests/config/test_checks.py::"
               "test_a_tokenizer_that_loads_only_with_its_own_code_needs_trust_remote_code",
               IN_PROCESS, ENGINES + "test_the_servers_run_the_models_own_code_only_with_trust_remote_code")

# Algorithms chosen from the spec.
CHOSEN_LOSS = ROLES + "test_the_actor_gets_the_chosen_loss_and_every_knob"
LOSSES_FIT = "tests/driver/test_algorithms_fit.py::test_policy_loss_runs_the_fit_loop"
LOSS_PLUGIN = ("tests/rank/roles/test_actor.py::"
               "test_the_docs_loss_plugin_trains_in_a_rank_process_like_the_builtin_it_restates")
LORA_RANK = "tests/rank/test_lora_rank.py::"
LORA_SPEC = LORA_RANK + "test_the_spec_puts_adapters_of_its_rank_scale_and_dropout_on_the_chosen_linears"
LORA_PARITY = "tests/models/test_lora.py::test_lora_trains_and_merges_at_every_layout_as_at_tp1"
LORA_ONLY = "tests/models/test_lora.py::test_only_the_adapters_get_gradients_and_optimizer_state"
RM_FIT = ("tests/driver/test_reward_model_fit.py::"
          "test_the_reward_model_scores_alone_and_the_policy_learns_its_preference")
RM_ROLE = ("tests/driver/test_reward_model_fit.py::"
           "test_the_reward_model_role_has_the_specs_layout_batching_and_offload")
RM_PARITY = "tests/rank/roles/test_reward_model.py::test_scores_equal_transformers_at_tp1_and_tp2"
RM_MANAGER = "tests/rewards/test_model_rewards.py::"
RM_HANDED = RM_MANAGER + "test_the_spec_hands_the_weights_and_the_combiner_to_the_manager"
RM_CHECKS = "tests/config/test_checks.py::test_a_reward_model_with_two_labels_or_a_layout_that_does_not_fit_is_named"
CLIP_COV = "tests/algorithms/test_policy_loss.py::test_clip_cov_by_hand"
KL_COV = "tests/algorithms/test_policy_loss.py::test_kl_cov_by_hand"

# verl's keys that became settings, rewards, traces.
VERL_RUN = "tests/driver/test_verl_command.py::"
CRITIC_WARMUP = VERL_RUN + "test_the_actor_waits_for_the_critic_warmup"
OLD_LOG_PROB_BATCHES = VERL_RUN + "test_the_old_log_prob_pass_cuts_its_own_micro_batches"
TRACE_MLFLOW = VERL_RUN + "test_each_steps_rollout_samples_are_text_in_mlflow"
TRACE_CONSOLE = TRACKING + "test_console_prints_rollout_samples_each_prompt_once_then_its_responses"
TRACE_PROMPTS = "tests/driver/test_rollout_trace.py::test_no_limit_traces_every_group"
BATCH_BUDGET = REWARDS + "test_the_batch_budget_ends_a_batch_of_slow_samples"
ASYNC_REWARDS = REWARDS + "test_an_async_function_runs_concurrently_in_one_worker_as_many_at_once_as_allowed"

# MoE routing replay (rlmegatron/models/routing_replay.py).
REPLAY = "tests/models/test_routing_replay.py::"
REPLAY_EXACT = REPLAY + "test_replaying_the_models_own_routing_changes_nothing_bit_for_bit_in_every_layout"
REPLAY_OTHER = REPLAY + "test_replaying_other_experts_changes_the_log_probs_and_the_router_still_learns"
REPLAY_AGREEMENT = REPLAY + "test_the_engine_records_every_token_it_ran_and_megatron_routes_them_alike_in_fp32"
REPLAY_SETTINGS = ROLES + "test_the_actor_settings_carry_the_moe_routing_fields_and_the_reference_routes_freely"
REPLAY_CHECKS = ("tests/config/test_checks.py::"
                 "test_routing_replay_needs_routers_a_pass_to_record_and_engines_that_return_routing")
REPLAY_REQUESTS = FIT + "test_the_rollout_asks_the_engines_for_their_routing_only_when_the_actor_uses_it"
ON_POLICY_CHECK = (FIT + "test_the_on_policy_check_adds_the_old_log_prob_pass_and_stops_a_step_whose_engine_sampled_"
                   "off_policy")
COLLECTIVE_TIMEOUT = ("tests/driver/test_moe_fit.py::test_a_rank_that_stops_answering_stops_the_run_within_the_"
                      "collective_timeout_naming_step_and_call")

EFFECTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "actor.clip_ratio_c": ("dual-clip bound of the policy loss", (ACTOR_SETTINGS, CLIPS)),
    "actor.clip_ratio_high": ("upper ratio clip of the policy loss", (ACTOR_SETTINGS, CLIPS)),
    "actor.clip_ratio_low": ("lower ratio clip of the policy loss", (ACTOR_SETTINGS, CLIPS)),
    "actor.entropy_coeff": ("entropy bonus in the actor loss", (ACTOR_SETTINGS, ENTROPY_BONUS)),
    "actor.kl_loss_coef": ("weight of the KL loss", (ACTOR_SETTINGS, KL_LOSS)),
    "actor.kl_loss_type": ("estimator of the KL loss", (ACTOR_SETTINGS, KL_ESTIMATORS)),
    "actor.lora.alpha": ("scale alpha / rank of the adapters' update", (LORA_SPEC, NEVER_TRAINS)),
    "actor.lora.dropout": ("dropout on the adapters' input", (LORA_SPEC,)),
    "actor.lora.modules_to_save": ("modules that train whole beside the adapters, base values with them off",
                                   (LORA_RANK + "test_the_reference_is_the_actor_with_its_adapters_off",
                                    LORA_RANK + "test_the_engine_and_the_hf_export_get_the_merged_weights",
                                    LORA_RANK + "test_a_checkpoint_holds_the_adapters_and_the_modules_trained_whole_"
                                    "and_resumes_them",
                                    "tests/planner/test_memory.py::"
                                    "test_lora_trains_only_the_adapters_split_over_tp_like_their_weights", CHECKS)),
    "actor.lora.rank": ("LoRA: only adapters of that rank train, the reference is the actor with them off, engines "
                        "and HF export get merged weights, checkpoints hold the adapters",
                        (LORA_SPEC, LORA_PARITY, LORA_ONLY,
                         LORA_RANK + "test_the_reference_is_the_actor_with_its_adapters_off",
                         LORA_RANK + "test_the_engine_and_the_hf_export_get_the_merged_weights",
                         LORA_RANK + "test_a_checkpoint_holds_the_adapters_and_the_modules_trained_whole_and_resumes_them",
                         CHECKS)),
    "actor.lora.target_modules": ("the linears that get adapters", (LORA_SPEC, NEVER_TRAINS)),
    "actor.lora.weight_sync": ("merged weights (quantised merged with rollout.quantization=fp8, which adapter sync "
                               "refuses), or SGLang loads the adapters and samples with them",
                               (LORA_RANK + "test_the_engine_and_the_hf_export_get_the_merged_weights",
                                "tests/driver/test_lora_fit.py::"
                                "test_adapter_sync_loads_each_steps_adapter_and_samples_with_it",
                                "tests/rollout/test_sglang.py::"
                                "test_a_lora_adapter_is_loaded_sampled_with_and_replaced_by_the_next", CHECKS)),
    "actor.loss_agg_mode": ("how actor and critic losses are reduced", (ACTOR_SETTINGS, CRITIC_SETTINGS, AGGREGATION)),
    "actor.megatron.context_parallel_size": ("actor's context parallelism (each sequence split over CP ranks)",
                                             (CP_ROLES, ACTOR_PARITY, UNEVEN_PIPELINE, SP_PARITY)),
    "actor.megatron.expert_model_parallel_size": ("actor's expert parallelism", (LAYOUT, MOE_EP2)),
    "actor.megatron.expert_tensor_parallel_size": ("actor's expert tensor parallelism", (LAYOUT, ETP_EXPORT)),
    "actor.megatron.extra": ("TransformerConfig fields; uneven pipeline split (DeepStack's layers on the first stage)",
                             (TO_TRANSFORMER_CONFIG, UNEVEN_PIPELINE, DEEPSEEK_SPLIT, DEEPSTACK_SPLIT)),
    "actor.megatron.pipeline_model_parallel_size": ("actor's pipeline stages", (LAYOUT, ACTOR_PARITY, DEEPSTACK_SPLIT)),
    "actor.megatron.recompute_granularity": ("activation recompute, selective or full",
                                             (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "actor.megatron.recompute_method": ("which layers full recompute takes", (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "actor.megatron.recompute_num_layers": ("layers per full-recompute unit", (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "actor.megatron.sequence_parallel": ("actor's sequence parallelism", (LAYOUT, SP_PARITY)),
    "actor.megatron.tensor_model_parallel_size": ("actor's tensor parallelism", (LAYOUT, ACTOR_PARITY)),
    "actor.megatron.use_distributed_optimizer": ("Adam state sharded over DP or per rank", (PLAIN_ADAM,)),
    "actor.megatron.virtual_pipeline_model_parallel_size": ("actor's virtual pipeline stages", (LAYOUT, ACTOR_PARITY)),
    "actor.moe.routing_agreement": ("engines return routing; moe/routing_agreement logged",
                                    (REPLAY_SETTINGS, REPLAY_REQUESTS, REPLAY_AGREEMENT, REPLAY_CHECKS)),
    "actor.moe.routing_replay": ("the actor's passes take recorded experts: the rollout's (r3) or the old-log-prob "
                                 "pass's (r2)", (REPLAY_SETTINGS, REPLAY_REQUESTS, REPLAY_EXACT, REPLAY_OTHER,
                                                 REPLAY_CHECKS)),
    "actor.mtp.detach": ("the MTP loss trains the MTP layers alone, the policy's step the RL loss's; refused "
                         "without a loss weight", (MTP_DETACHED, NEVER_TRAINS)),
    "actor.mtp.loss_weight": ("the MTP layers train with the policy (Megatron's MTP loss on the response tokens); "
                              "refused for a model without MTP layers; rlm plan's mtp_update phase",
                              (MTP_CHECKS, MTP_TRAINS, MTP_OFF, MTP_PLAN)),
    "actor.offload.grads": ("actor grads offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "actor.offload.optimizer": ("actor Adam state offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "actor.offload.params": ("actor weights offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "actor.optim.adam_beta1": ("actor Adam beta1", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.optim.adam_beta2": ("actor Adam beta2", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.optim.adam_eps": ("actor Adam epsilon", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.optim.clip_grad": ("actor gradient-norm clip", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.optim.lr": ("actor learning rate", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.optim.lr_decay_style": ("constant, linear or cosine decay", (ACTOR_SETTINGS, LR_SCHEDULE, IN_PROCESS)),
    "actor.optim.lr_warmup_steps": ("linear warm-up steps", (ACTOR_SETTINGS, LR_SCHEDULE, LR_RESUMED)),
    "actor.optim.min_lr": ("learning rate at the run's last step", (ACTOR_SETTINGS, LR_SCHEDULE, IN_PROCESS)),
    "actor.optim.weight_decay": ("actor weight decay", (ACTOR_SETTINGS, RANK_OPTIMIZER)),
    "actor.policy_loss.clip_cov_lb": ("Clip-Cov's lower covariance bound", (CHOSEN_LOSS, CLIP_COV)),
    "actor.policy_loss.clip_cov_ratio": ("share of tokens Clip-Cov detaches", (CHOSEN_LOSS, CLIP_COV)),
    "actor.policy_loss.clip_cov_ub": ("Clip-Cov's upper covariance bound", (CHOSEN_LOSS, CLIP_COV)),
    "actor.policy_loss.kl_cov_ratio": ("share of tokens KL-Cov penalises", (CHOSEN_LOSS, KL_COV)),
    "actor.policy_loss.loss_mode": ("the policy loss (registry or plug-in)", (CHOSEN_LOSS, LOSSES_FIT, LOSS_PLUGIN)),
    "actor.policy_loss.ppo_kl_coef": ("KL-Cov's penalty weight", (CHOSEN_LOSS, KL_COV)),
    "actor.ppo_epochs": ("passes of the actor over each step's batch", (ACTOR_SETTINGS, RANK_BATCHING)),
    "actor.ppo_max_token_len_per_gpu": ("actor micro-batch token budget (per GPU: x CP per micro-batch)",
                                        (ACTOR_SETTINGS, ACTOR_PARITY, CP_TOKEN_BUDGET)),
    "actor.ppo_micro_batch_size_per_gpu": ("sequences per actor micro-batch", (ACTOR_SETTINGS, RANK_BATCHING)),
    "actor.ppo_mini_batch_size": ("prompts per actor optimizer step", (ACTOR_SETTINGS, RANK_BATCHING)),
    "actor.use_dynamic_bsz": ("actor micro-batches by token budget", (ACTOR_SETTINGS, ACTOR_PARITY)),
    "actor.use_kl_loss": ("KL loss term and the reference model", (ACTOR_SETTINGS, DAPO_RUN)),
    "actor.vision.freeze": ("a vision-language actor's (and critic's) image encoder keeps its weights, or trains",
                            (VISION + "test_actor_vision_freeze_reaches_the_trainer_ranks",
                             VISION + "test_a_frozen_tower_keeps_its_weights_through_an_update_and_a_trained_one_moves",
                             QWEN3_VL + "test_a_frozen_towers_weights_are_not_resent_after_the_first_sync")),
    "algorithm.adv_estimator": ("advantage estimator (and the critic for gae)", (ESTIMATORS, PPO_RUN)),
    "algorithm.distill.baseline": ("each prompt's mean term taken out (group_mean), or none; n=1 refused",
                                   (DISTILL_BASELINE, DISTILL_RUN, DISTILL_SPEC + "test_distillation_alone_needs_no_"
                                    "groups_and_refuses_the_estimators_settings")),
    "algorithm.distill.coef": ("weight of the teacher's per-token reverse KL in the advantage",
                               (DISTILL_ALONE, DISTILL_RUN)),
    "algorithm.distill.mode": ("the divergence (reverse_kl); another refused", (DISTILL_ALONE, TEACHER_REFUSALS)),
    "algorithm.distill.only": ("the teacher's term alone (no estimator, no groups), or added to the estimator's",
                               (DISTILL_ALONE, DISTILL_ADDED, DISTILL_RUN, DISTILL_SPEC + "test_distillation_alone_"
                                "needs_no_groups_and_refuses_the_estimators_settings")),
    "algorithm.dynamic_sampling.enable": ("drop all-equal groups and generate more", (DYNAMIC_SAMPLING, DAPO_RUN)),
    "algorithm.dynamic_sampling.max_num_gen_batches": ("rounds per step; 0 rejected", (DYNAMIC_SAMPLING, ROUNDS_BOUND)),
    "algorithm.gamma": ("discount of gae and reinforce_plus_plus", (GAE, ESTIMATORS + "[reinforce_plus_plus]")),
    "algorithm.kl_ctrl.horizon": ("adaptive KL controller horizon", (KL_IN_REWARD,)),
    "algorithm.kl_ctrl.kl_coef": ("initial in-reward KL coefficient", (KL_IN_REWARD,)),
    "algorithm.kl_ctrl.target_kl": ("adaptive KL controller target", (KL_IN_REWARD,)),
    "algorithm.kl_ctrl.type": ("fixed or adaptive in-reward KL coefficient", (KL_IN_REWARD,)),
    "algorithm.kl_penalty": ("estimator of the in-reward KL", (KL_IN_REWARD,)),
    "algorithm.lam": ("GAE lambda", (GAE,)),
    "algorithm.norm_adv_by_std_in_grpo": ("GRPO divides by the group std", (GRPO_STD,)),
    "algorithm.rollout_correction.rollout_is": ("IS weights per token or sequence on the policy loss",
                                                (CORRECTION_FIT, IS_BY_HAND, IS_WEIGHTS)),
    "algorithm.rollout_correction.rollout_is_mode": ("truncated (TIS) or masked (MIS) weights",
                                                     (CORRECTION_FIT, IS_BY_HAND)),
    "algorithm.rollout_correction.rollout_is_threshold": ("the IS cap", (CORRECTION_FIT, IS_BY_HAND)),
    "algorithm.rollout_correction.rollout_rs": ("tokens or sequences out of bounds leave the loss",
                                                (CORRECTION_FIT, RS_BY_HAND)),
    "algorithm.rollout_correction.rollout_rs_threshold": ("rejection's upper bound", (CORRECTION_FIT, RS_BY_HAND)),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": ("rejection's lower bound",
                                                                (CORRECTION_FIT, RS_BY_HAND)),
    "algorithm.rollout_correction.rollout_token_veto_threshold": ("one token below it rejects its sequence",
                                                                  (CORRECTION_FIT, VETO)),
    "algorithm.use_kl_in_reward": ("KL penalty in the rewards", (KL_IN_REWARD,)),
    "critic.cliprange_value": ("value clip of the critic loss", (CRITIC_SETTINGS, VALUE_CLIP)),
    "critic.enable": ("builds and trains the critic (follows gae)", (PPO_RUN, CHECKS + "[gae-needs-critic]")),
    "critic.init_from": ("critic starts from an HF reward model", (RANK_MODEL, REWARD_MODEL_CRITIC)),
    "critic.megatron.context_parallel_size": ("critic's context parallelism", (CP_ROLES, CP_CRITIC)),
    "critic.megatron.expert_model_parallel_size": ("critic's expert parallelism", (LAYOUT, OWN_LAYOUTS)),
    "critic.megatron.expert_tensor_parallel_size": ("critic's expert tensor parallelism", (LAYOUT, OWN_LAYOUTS)),
    "critic.megatron.extra": ("critic's TransformerConfig fields", (TO_TRANSFORMER_CONFIG, OWN_LAYOUTS)),
    "critic.megatron.pipeline_model_parallel_size": ("critic's pipeline stages", (OWN_LAYOUTS, OWN_CHECKPOINTS)),
    "critic.megatron.recompute_granularity": ("critic's activation recompute", (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "critic.megatron.recompute_method": ("critic's full-recompute layers", (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "critic.megatron.recompute_num_layers": ("critic's full-recompute unit", (RECOMPUTE, TO_TRANSFORMER_CONFIG)),
    "critic.megatron.sequence_parallel": ("critic's sequence parallelism", (LAYOUT, OWN_LAYOUTS)),
    "critic.megatron.tensor_model_parallel_size": ("critic's tensor parallelism", (OWN_LAYOUTS, OWN_CHECKPOINTS)),
    "critic.megatron.use_distributed_optimizer": ("critic's Adam sharded or per rank", (PPO_RUN, PLAIN_ADAM)),
    "critic.megatron.virtual_pipeline_model_parallel_size": ("critic's virtual pipeline stages", (LAYOUT, OWN_LAYOUTS)),
    "critic.offload.grads": ("critic grads offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "critic.offload.optimizer": ("critic Adam state offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "critic.offload.params": ("critic weights offloaded between phases", (OFFLOAD, RANK_OFFLOAD, ROUND_TRIP)),
    "critic.optim.adam_beta1": ("critic Adam beta1", (CRITIC_SETTINGS, RANK_OPTIMIZER)),
    "critic.optim.adam_beta2": ("critic Adam beta2", (CRITIC_SETTINGS, RANK_OPTIMIZER)),
    "critic.optim.adam_eps": ("critic Adam epsilon", (CRITIC_SETTINGS, RANK_OPTIMIZER)),
    "critic.optim.clip_grad": ("critic gradient-norm clip", (CRITIC_SETTINGS, RANK_OPTIMIZER)),
    "critic.optim.lr": ("critic learning rate", (CRITIC_SETTINGS, RANK_OPTIMIZER, PPO_RUN)),
    "critic.optim.lr_decay_style": ("critic's lr decay", (CRITIC_SETTINGS, PPO_RUN)),
    "critic.optim.lr_warmup_steps": ("critic's lr warm-up", (CRITIC_SETTINGS, PPO_RUN)),
    "critic.optim.min_lr": ("critic's final lr", (CRITIC_SETTINGS, PPO_RUN)),
    "critic.optim.weight_decay": ("critic weight decay", (CRITIC_SETTINGS, RANK_OPTIMIZER)),
    "critic.ppo_epochs": ("passes of the critic over each step's batch", (CRITIC_SETTINGS, RANK_BATCHING)),
    "critic.ppo_max_token_len_per_gpu": ("critic micro-batch token budget",
                                         (CRITIC_SETTINGS, RANK_BATCHING, CP_TOKEN_BUDGET)),
    "critic.ppo_micro_batch_size_per_gpu": ("sequences per critic micro-batch", (CRITIC_SETTINGS, RANK_BATCHING)),
    "critic.ppo_mini_batch_size": ("prompts per critic optimizer step", (CRITIC_SETTINGS, RANK_BATCHING)),
    "critic.use_dynamic_bsz": ("critic micro-batches by token budget", (CRITIC_SETTINGS, RANK_BATCHING)),
    "data.answer_key": ("where each row's ground truth is read", (ANSWER_KEY,)),
    "data.dataset_class": ("custom dataset plug-in", (CUSTOM_DATASET,)),
    "data.filter_overlong_prompts": ("drop, not reject, overlong prompts", (OVERLONG_DROPPED, OVERLONG_REJECTED)),
    "data.image_key": ("the column of a row's images, read through a vision-language model's image processor",
                       (IMAGES + "test_data_image_key_names_the_images_column",
                        IMAGES + "test_images_as_paths_and_records_become_one_placeholder_token_per_merged_patch")),
    "data.max_image_pixels": ("larger images refused, one line naming the row",
                              (IMAGES + "test_a_bad_image_is_one_line_naming_the_row_and_the_fix",)),
    "data.max_prompt_length": ("longest prompt kept", (OVERLONG_DROPPED,)),
    "data.max_response_length": ("default generation length; DAPO's L_max", (RESPONSE_LENGTH, JOB_WIRING)),
    "data.prompt_format": ("chat messages templated, or a plain text as it is", (PLAIN_PROMPTS,)),
    "data.prompt_key": ("row key of the prompt", (PROMPT_KEY,)),
    "data.seed": ("seed of the shuffled prompt order", (JOB_WIRING, SEEDED_ORDER)),
    "data.shuffle": ("prompt order shuffled or as stored", (JOB_WIRING, STORED_ORDER)),
    "data.train_batch_size": ("prompts per step", (SAMPLING, RAY_LOOP, JOB_WIRING)),
    "data.train_files": ("training prompts", (GSM8K, JOB_WIRING)),
    "data.val_batch_size": ("prompts per validation batch", (VALIDATION,)),
    "data.val_files": ("validation prompts", (RAY_LOOP, JOB_WIRING)),
    "model.dtype": ("dtype of every role's weights and the engines'", (RANK_MODEL, SERVER_DTYPE)),
    "model.hf_config": ("hub model's architecture for validate and plan", (HUB_ARCHITECTURE, HUB_SNAPSHOT)),
    "model.path": ("the model every role and engine starts from (a hub id: its snapshot)", (IN_PROCESS, HUB_SNAPSHOT)),
    "model.random_init": ("random weights instead of the checkpoint's", (IN_PROCESS,)),
    "model.tokenizer_path": ("tokenizer of prompts and rewards", (GSM8K, JOB_WIRING)),
    "model.trust_remote_code": ("the model's and tokenizer's own code allowed", REMOTE_CODE),
    "placement.device": ("cuda/nccl or cpu/gloo", (IN_PROCESS,)),
    "placement.gpus_per_node": ("trainer ranks per node, each node's exactly", (TRAINER_POOL, MULTI_NODE, RESUME)),
    "placement.mode": ("engines in the trainer ranks or on their own pool", (ROUTED_RUN, ASYNC_RUN)),
    "placement.nnodes": ("trainer nodes, distinct ones", (TRAINER_POOL, MULTI_NODE)),
    "placement.rollout_gpus_per_node": ("rollout pool GPUs per node", (DISAGGREGATED_SERVER, ENGINE_POOL)),
    "placement.rollout_max_engines": ("the most engines the rollout pool grows to while the job runs",
                                      (ELASTIC, POOL_CONTROL + "test_requests_are_taken_once_in_order_and_cut_to_the_"
                                       "bounds", "tests/config/test_checks.py::test_check_fires_with_field_value_and_"
                                       "fix")),
    "placement.rollout_min_engines": ("the fewest engines the rollout pool shrinks to while the job runs",
                                      (POOL_CONTROL + "test_requests_are_taken_once_in_order_and_cut_to_the_bounds",
                                       "tests/config/test_checks.py::test_check_fires_with_field_value_and_fix")),
    "placement.rollout_nnodes": ("rollout pool nodes, of its own where the cluster has them",
                                 (DISAGGREGATED_SERVER, ENGINE_POOL, OWN_NODES)),
    "placement.transport": ("trainer ranks as local processes without Ray, or as Ray actors",
                           (PROCESSES_RUN, RAY_LOOP, TRANSPORT_AUTO, CHECKS)),
    "ref.log_prob_max_token_len_per_gpu": ("reference micro-batch token budget", (REF_BATCHING,)),
    "ref.log_prob_micro_batch_size_per_gpu": ("sequences per reference micro-batch", (REF_BATCHING,)),
    "ref.log_prob_use_dynamic_bsz": ("reference micro-batches by token budget", (REF_BATCHING,)),
    "ref.megatron.context_parallel_size": ("reference's context parallelism", (CP_ROLES,)),
    "ref.megatron.expert_model_parallel_size": ("reference's expert parallelism", (MOE_REFERENCE,)),
    "ref.megatron.expert_tensor_parallel_size": ("reference's expert tensor parallelism", (LAYOUT, MOE_REFERENCE)),
    "ref.megatron.extra": ("reference's TransformerConfig fields", (TO_TRANSFORMER_CONFIG, OWN_LAYOUTS)),
    "ref.megatron.pipeline_model_parallel_size": ("reference's pipeline stages", (LAYOUT, OWN_LAYOUTS)),
    "ref.megatron.recompute_granularity": ("rejected: the reference never trains", (NEVER_TRAINS,)),
    "ref.megatron.recompute_method": ("rejected: the reference never trains", (NEVER_TRAINS,)),
    "ref.megatron.recompute_num_layers": ("rejected: the reference never trains", (NEVER_TRAINS,)),
    "ref.megatron.sequence_parallel": ("reference's sequence parallelism", (LAYOUT, OWN_LAYOUTS)),
    "ref.megatron.tensor_model_parallel_size": ("reference's tensor parallelism", (OWN_LAYOUTS,)),
    "ref.megatron.use_distributed_optimizer": ("rejected: the reference never trains", (NEVER_TRAINS,)),
    "ref.megatron.virtual_pipeline_model_parallel_size": ("reference's virtual pipeline stages", (LAYOUT, OWN_LAYOUTS)),
    "ref.offload.params": ("reference weights offloaded between phases", (OFFLOAD, RANK_OFFLOAD, REFERENCE)),
    "reward.async_concurrency": ("async reward calls at once", (ASYNC_REWARDS,)),
    "reward.batch_timeout_s": ("time budget of one scoring batch", (BATCH_BUDGET,)),
    "reward.function": ("reward plug-in", (NAN_RUN, DAPO_PENALTY)),
    "reward.manager": ("naive or DAPO reward manager", (DAPO_PENALTY,)),
    "reward.max_timeout_fraction": ("timed-out samples of a batch that stop the run", (TIMEOUT_FRACTION,
                                                                                       TIMEOUT_STOPS_RUN)),
    "reward.model.combiner": ("a plug-in combines the model's and the rule's scores",
                              (RM_HANDED, RM_MANAGER + "test_a_combiner_plugin_computes_the_reward")),
    "reward.model.micro_batch_size_per_gpu": ("sequences per reward-model forward pass", (RM_ROLE, RM_PARITY)),
    "reward.model.offload.params": ("reward model's weights offloaded between uses", (RM_ROLE, RM_PARITY, RM_FIT)),
    "reward.model.path": ("a reward model scores prompt + response in the trainer ranks",
                          (RM_FIT, RM_PARITY, RM_CHECKS, CHECKS,
                           RM_MANAGER + "test_the_model_reads_its_own_chat_template_when_it_differs_from_the_policys")),
    "reward.model.rule_weight": ("weight of the rule's score; 0 runs no rule",
                                 (RM_HANDED, RM_MANAGER + "test_the_model_alone_scores_without_running_the_rule")),
    "reward.model.sequence_parallel": ("reward model's sequence parallelism", (RM_ROLE, RM_PARITY, RM_FIT)),
    "reward.model.tensor_model_parallel_size": ("reward model's tensor parallelism", (RM_ROLE, RM_PARITY, RM_FIT,
                                                                                     RM_CHECKS)),
    "reward.model.weight": ("weight of the model's score", (RM_HANDED, RM_FIT)),
    "reward.num_workers": ("reward processes", (REWARD_WORKERS, JOB_WIRING)),
    "reward.overlong_buffer.enable": ("DAPO overlong penalty on", (DAPO_PENALTY, DAPO_OFF)),
    "reward.overlong_buffer.length": ("DAPO overlong buffer", (DAPO_PENALTY,)),
    "reward.overlong_buffer.penalty_factor": ("DAPO overlong penalty scale", (PENALTY_FACTOR,)),
    "reward.timeout_s": ("time a reward call may take", (REWARD_TIMEOUT,)),
    "rollout.autoscale": ("the driver adds engines as nodes join and as the steps wait for rollouts, removes idle ones",
                          (POOL_CONTROL + "test_autoscale_adds_when_the_trainer_waited_two_steps_and_removes_after_"
                           "three_idle_ones",
                           POOL_CONTROL + "test_autoscale_adds_an_engine_for_each_node_that_joins_the_cluster_up_to_"
                           "the_bound")),
    "rollout.enable_dp_attention": ("SGLang DP attention", (LAUNCH,)),
    "rollout.engine": ("local or SGLang engines", (COLOCATED_SERVER,)),
    "rollout.expert_parallel_size": ("SGLang expert parallelism", (LAUNCH,)),
    "rollout.full_sync_every": ("delta sync: every N syncs a full push",
                                (DELTA_SYNC + "test_disaggregated_delta_sync_on_an_moe_at_ep2_pushes_whole_every_full_"
                                 "sync_every",)),
    "rollout.log_prob_micro_batch_size_per_gpu": ("sequences per old-log-prob micro-batch", (OLD_LOG_PROB_BATCHES,)),
    "rollout.max_new_tokens": ("generation length and batch width", (SAMPLING,)),
    "rollout.mem_fraction_static": ("SGLang static memory share", (LAUNCH,)),
    "rollout.multi_turn.max_tool_response_length": ("tokens of one tool answer", (AGENT_SETTINGS, AGENT_TURNS)),
    "rollout.multi_turn.max_turns": ("model turns per trajectory", (AGENT_SETTINGS, AGENT_TURNS)),
    "rollout.multi_turn.tool_call_format": ("how tool calls are read from a turn", (AGENT_SETTINGS, AGENT_CALLS)),
    "rollout.multi_turn.tool_timeout_s": ("seconds a tool call may take", (AGENT_SETTINGS, TOOL_TIMEOUT)),
    "rollout.multi_turn.tools": ("the tools, and multi-turn rollouts at all", (AGENT_SETTINGS, AGENT_TOKENS)),
    "rollout.n": ("samples per prompt", (SAMPLING, RAY_LOOP)),
    "rollout.num_gpus": ("GPUs the engines use", (ENGINE_POOL,)),
    "rollout.quantization": ("fp8: the weight sync quantises the projections block-wise; the engines sample with "
                             "those weights (SGLang launched to hold them in FP8, the local engine dequantised); "
                             "rlm plan counts them",
                             (ROLES + "test_rollout_quantization_fp8_has_the_engine_sample_with_the_actors_weights_"
                              "quantised_block_wise",
                              "tests/rollout/test_local.py::test_fp8_weight_updates_are_held_quantised_then_dequantised",
                              LORA_RANK + "test_fp8_rollout_quantises_the_merged_weights",
                              "tests/rollout/test_sglang.py::test_fp8_rollout_launches_servers_that_hold_block_wise_fp8_"
                              "weights",
                              "tests/planner/test_memory.py::test_fp8_rollout_holds_and_syncs_the_projections_in_a_byte_"
                              "and_a_scale_per_block",
                              "tests/config/test_checks.py::test_check_fires_with_field_value_and_fix",
                              "tests/config/test_checks.py::test_fp8_rollout_names_each_projection_sglang_cannot_hold_"
                              "in_whole_fp8_blocks")),
    "rollout.seed": ("sampling seeds of rollout and validation (SGLang: with deterministic inference only)",
                     (SAMPLING, VALIDATION, NEVER_TRAINS)),
    "rollout.sglang.enable_memory_saver": ("SGLang memory saver", (LAUNCH, LAUNCH_OFF)),
    "rollout.sglang.extra_args": ("extra SGLang flags", (LAUNCH,)),
    "rollout.sglang.load_format": ("SGLang load format", (LAUNCH,)),
    "rollout.sglang.python": ("interpreter of the SGLang servers", (LAUNCH,)),
    "rollout.sglang.router": ("sglang_router in front of the servers", (ROUTED_RUN,)),
    "rollout.sglang.router_args": ("extra router flags", (ROUTED_RUN,)),
    "rollout.sglang.router_url": ("a running router the servers join", (BUCKETS_AND_ROUTER,)),
    "rollout.sglang.skip_tokenizer_init": ("SGLang without a tokenizer", (LAUNCH, LAUNCH_OFF)),
    "rollout.sglang.startup_timeout_s": ("time a server has to become healthy", (STARTUP_TIMEOUT,)),
    "rollout.speculative.method": ("speculative decoding drafted by the model's MTP layers (SGLang: NEXTN, its draft "
                                   "loading the synced MTP names; the local engine: its own draft and rejection "
                                   "sampling, the main model's outputs); refused without them",
                                   (MTP_CHECKS, SGLANG_SPECULATIVE, SGLANG_DRAFT_NAMES, SPECULATIVE_PLAN,
                                    LOCAL_SPECULATIVE_RUN,
                                    *LOCAL_SPECULATIVE_EXACT, "tests/config/test_checks.py::test_the_local_engines_"
                                    "speculative_decoding_records_no_routing_for_r3")),
    "rollout.speculative.num_draft_tokens": ("tokens drafted per verification (SGLang: k steps, k + 1 draft tokens)",
                                             (MTP_CHECKS, SGLANG_SPECULATIVE, SPECULATIVE_PLAN, LOCAL_SPECULATIVE_RUN,
                                              LOCAL_SPECULATIVE_EXACT[1], LOCAL_SPECULATIVE + "test_the_local_server_"
                                              "drafts_when_launched_with_sglangs_speculative_flags")),
    "rollout.stop_token_ids": ("tokens that end a sample", (SAMPLING,)),
    "rollout.temperature": ("sampling temperature; actor log-prob temperature", (SAMPLING, ACTOR_SETTINGS)),
    "rollout.tensor_parallel_size": ("GPUs per SGLang server", (COLOCATED_SERVER, LAUNCH)),
    "rollout.top_k": ("top-k of rollout sampling", (SAMPLING,)),
    "rollout.top_p": ("top-p of rollout sampling", (SAMPLING,)),
    "rollout.update_weights_bucket_mb": ("size of the weight-sync buckets", (BUCKETS_AND_ROUTER,)),
    "rollout.val_kwargs.n": ("samples per validation prompt", (VALIDATION,)),
    "rollout.val_kwargs.temperature": ("validation temperature", (VALIDATION,)),
    "rollout.val_kwargs.top_k": ("validation top-k", (VALIDATION,)),
    "rollout.val_kwargs.top_p": ("validation top-p", (VALIDATION,)),
    "rollout.weight_sync": ("delta: pushes carry only the changed elements, exactly; refused where it cannot work",
                            (DELTA_SYNC + "test_delta_sync_holds_the_full_push_weights_at_every_step",
                             "tests/rollout/test_delta.py::test_every_push_leaves_the_engine_bit_for_bit_where_a_full_"
                             "push_would",
                             "tests/config/test_checks.py::test_check_fires_with_field_value_and_fix")),
    "teacher.hf_config": ("the teacher's architecture for a hub id",
                         (TEACHER_ARCH,)),
    "teacher.log_prob_max_token_len_per_gpu": ("teacher micro-batch token budget",
                                              (TEACHER_ROLE, TEACHER_BATCHING)),
    "teacher.log_prob_micro_batch_size_per_gpu": ("sequences per teacher micro-batch",
                                                 (TEACHER_ROLE, TEACHER_BATCHING)),
    "teacher.log_prob_use_dynamic_bsz": ("teacher micro-batches by token budget",
                                        (TEACHER_ROLE, TEACHER_BATCHING)),
    "teacher.megatron.context_parallel_size": ("teacher's context parallelism",
                                              (TEACHER_ROLE, CP_ROLES)),
    "teacher.megatron.expert_model_parallel_size": ("teacher's expert parallelism",
                                                   (TEACHER_ROLE, MOE_REFERENCE)),
    "teacher.megatron.expert_tensor_parallel_size": ("teacher's expert tensor parallelism",
                                                    (TEACHER_ROLE, MOE_REFERENCE)),
    "teacher.megatron.extra": ("teacher's TransformerConfig fields",
                              (TEACHER_ROLE, TO_TRANSFORMER_CONFIG)),
    "teacher.megatron.pipeline_model_parallel_size": ("teacher's pipeline stages",
                                                     (TEACHER_ROLE, TEACHER_LOG_PROBS)),
    "teacher.megatron.recompute_granularity": ("rejected: the teacher never trains",
                                              (TEACHER_REFUSALS,)),
    "teacher.megatron.recompute_method": ("rejected: the teacher never trains",
                                         (TEACHER_REFUSALS, NEVER_TRAINS)),
    "teacher.megatron.recompute_num_layers": ("rejected: the teacher never trains",
                                             (TEACHER_REFUSALS, NEVER_TRAINS)),
    "teacher.megatron.sequence_parallel": ("teacher's sequence parallelism",
                                          (TEACHER_ROLE, TEACHER_LOG_PROBS)),
    "teacher.megatron.tensor_model_parallel_size": ("teacher's tensor parallelism",
                                                   (TEACHER_ARCH, TEACHER_LOG_PROBS)),
    "teacher.megatron.use_distributed_optimizer": ("rejected: the teacher never trains",
                                                  (TEACHER_REFUSALS,)),
    "teacher.megatron.virtual_pipeline_model_parallel_size": ("teacher's virtual pipeline stages",
                                                             (TEACHER_ROLE, OWN_LAYOUTS)),
    "teacher.offload.params": ("teacher weights offloaded between phases",
                              (TEACHER_ROLE, TEACHER_BATCHING, RANK_OFFLOAD)),
    "teacher.path": ("the teacher checkpoint (HF or converted); its tokenizer must be the student's",
                    (TEACHER_LOG_PROBS, TEACHER_TOKENIZER, DISTILL_RUN)),
    "tracking.backends": ("console, MLflow, W&B and/or TensorBoard",
                          (MLFLOW_STORE, CONSOLE, EVERY_BACKEND, RESUMED_BACKENDS, RESUMED_RUN_BACKENDS,
                           MISSING_PACKAGE, WANDB_ACCOUNT)),
    "tracking.project_name": ("MLflow experiment, W&B project", (MLFLOW_STORE, EVERY_BACKEND)),
    "tracking.rollout_trace.backend": ("where each step's samples are logged as text",
                                       (TRACE_MLFLOW, TRACE_CONSOLE, EVERY_BACKEND)),
    "tracking.rollout_trace.prompts_per_step": ("prompts whose samples are traced", (TRACE_MLFLOW, TRACE_PROMPTS)),
    "tracking.tracking_uri": ("MLflow store", (TRACKING_URI, URI_ORDER, FILE_STORE)),
    "trainer.check_sync_every": ("every N syncs each engine's weights are checked against a full push's; a "
                                 "mismatch stops the run",
                                 (DELTA_SYNC + "test_an_engine_found_holding_other_weights_stops_the_run_in_one_line",
                                  "tests/rollout/test_delta.py::test_the_engines_checksums_match_a_full_push_and_name_"
                                  "the_tensor_that_differs")),
    "trainer.collective_timeout_s": ("a collective waiting longer stops the run, naming step and call",
                                     (COLLECTIVE_TIMEOUT,)),
    "trainer.critic_warmup": ("steps the critic trains alone", (CRITIC_WARMUP,)),
    "trainer.experiment_name": ("MLflow run name; default run_dir", (MLFLOW_STORE,)),
    "trainer.log_freq": ("steps between the console's full metric tables (one line on the others)",
                         (CONSOLE, QUIET_RUN)),
    "trainer.max_ckpt_to_keep": ("checkpoints kept", (SCHEDULE, JOB_WIRING)),
    "trainer.max_restarts": ("a dead trainer rank restarts the ranks from the last checkpoint, that many times",
                             (RANK_RESTART, RANK_RESTART_LIMIT)),
    "trainer.max_staleness": ("how far async rollouts may run ahead", (ASYNC_BOUND, ASYNC_RUN)),
    "trainer.mode": ("generation overlaps training (one_step_off, async) or not", (ONE_STEP_OFF, ASYNC_RUN,
                                                                                     MODE_ERRORS)),
    "trainer.on_policy_check": ("the step stops when an engine's log-prob is off the actor's by more",
                                (ON_POLICY_CHECK, NEVER_TRAINS)),
    "trainer.partial_rollout": ("weights swapped mid-generation, samples continued",
                                (PAUSED_PUSH, PARTIAL_SGLANG, PARTIAL_LOCAL, ASYNC_RUN)),
    "trainer.resume": ("checkpoint a run starts from", (RESUME,)),
    "trainer.run_dir": ("where checkpoints, logs and exports go", (SIGTERM, JOB_WIRING)),
    "trainer.save_freq": ("steps between checkpoints", (SCHEDULE, NAN_RUN)),
    "trainer.seed": ("seed of the random init and Megatron's RNG", (RANK_MODEL,)),
    "trainer.test_freq": ("steps between validations", (VALIDATION, RAY_LOOP)),
    "trainer.total_epochs": ("run length without total_steps", (SCHEDULE,)),
    "trainer.total_steps": ("run length", (SCHEDULE, IN_PROCESS)),
    "trainer.val_before_train": ("validation at step 0", (VALIDATION,)),
}
