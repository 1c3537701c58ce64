"""The shared SFT step of the tiny bundles' builds: padding and labels by hand, and a step that lowers the loss."""

import torch

from claas_verl.tiny.sft import padded_batch, sft_step


def test_padded_batch_masks_the_prompt_and_the_padding_out_of_the_labels():
    x, att, labels = padded_batch([([5, 6], [7]), ([8], [9, 10, 11])], pad_token_id=0)
    assert x.tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert att.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, 7, -100], [-100, 9, 10, 11]]


def test_sft_step_draws_with_the_generator_and_lowers_the_loss_on_its_batch():
    from claas_verl.tiny.model import build_student

    torch.manual_seed(0)
    model = build_student(32, [1], 0, seed=0)
    examples = [([2, 3, 4], [5, 6])] * 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = [float(sft_step(model, opt, examples, gen, 2, 0)) for _ in range(5)]
    assert losses[-1] < losses[0]
