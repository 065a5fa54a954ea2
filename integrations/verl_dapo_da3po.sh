#!/usr/bin/env bash
# DAPO + DA3PO in verl 0.9.1, one node of 8 GPUs: the DA3PO paper's runs as docs/gpu.md runs them with da3po.py
# (DAPO's published recipe: Qwen3-4B-Base on DAPO-Math-17k, 512 prompts x 16, 16 updates of 32 prompts, 2,048 +
# 20,480 tokens, overlong shaping over the last 4,096). Every override below is a key of verl's config:
# tests/test_verl.py composes them on verl's ppo_trainer config. Needs verl's own install
# (pip install -r requirements/verl.txt) and verl_da3po_daro.py in $DROPIN_DIR (by default this file's folder).
#   algorithm.adv_estimator=da3po        DAA (lam 2, tau 0.5) on GRPO's advantages; correct = score > -0.5,
#                                        so a correct answer at the cap (1 - 1 = 0) counts as correct
#   algorithm.filter_groups.metric=acc   DAPO's filter on correctness: verl's default `reward` would keep
#                                        all-correct groups whose shaped scores differ
#   ...filter_groups.max_inflight_gen_batches=3   prompt batches in flight to refill from (DAPO's 3 x 512)
#   actor.clip_ratio_c=1e9               dual clip off, as in the papers: verl's default 3.0 caps the loss of
#                                        negative advantages; verl needs c > 1 and caps the ratio at e^20 < 1e9
#   actor.policy_loss.loss_mode=vanilla, loss_agg_mode=token-mean, clip 0.2 / 0.28: DAPO's loss, verl's own
#   actor.optim: lr 1e-6, 10 warm-up steps, weight decay 0.1 (verl's default 0.01), grad_clip 1.0
#   no KL anywhere (use_kl_loss, use_kl_in_reward false); reward manager `dapo`: +1/-1 from math_dapo's scorer
#   (the dataset's data_source) plus the soft overlong punishment
set -euo pipefail
DROPIN_DIR=${DROPIN_DIR:-$(cd "$(dirname "$0")" && pwd)}
MODEL=${MODEL:-Qwen/Qwen3-4B-Base}
TRAIN=${TRAIN:-dapo-math-17k.parquet}
VAL=${VAL:-aime-2024.parquet}
OUT=${OUT:-runs/verl_dapo_da3po}
export VERL_USE_EXTERNAL_MODULES=verl_da3po_daro  # imported wherever verl is: the trainer and every worker
export PYTHONPATH=$DROPIN_DIR${PYTHONPATH:+:$PYTHONPATH}
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=da3po \
    algorithm.use_kl_in_reward=false \
    algorithm.filter_groups.enable=true \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_inflight_gen_batches=3 \
    data.train_files=$TRAIN \
    data.val_files=$VAL \
    data.prompt_key=prompt \
    data.train_batch_size=512 \
    data.max_prompt_length=2048 \
    data.max_response_length=20480 \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.policy_loss.loss_mode=vanilla \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=1e9 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
    actor_rollout_ref.rollout.val_kwargs.n=32 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true \
    reward.reward_manager.name=dapo \
    +reward.reward_kwargs.overlong_buffer_cfg.enable=true \
    +reward.reward_kwargs.overlong_buffer_cfg.len=4096 \
    +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward.reward_kwargs.overlong_buffer_cfg.log=false \
    +reward.reward_kwargs.max_resp_len=20480 \
    trainer.total_training_steps=300 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=10 \
    trainer.test_freq=20 \
    trainer.resume_mode=auto \
    trainer.project_name=da3po \
    trainer.experiment_name=verl_dapo_da3po \
    trainer.default_local_dir=$OUT \
    "$@"
