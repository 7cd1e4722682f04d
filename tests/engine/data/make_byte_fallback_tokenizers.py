#!/usr/bin/env python3
"""Writes the SentencePiece-style tokenizers of the byte-fallback tests and the ids that
Hugging Face's `tokenizers` gives with them:

  llama2_style_tokenizer.json   BPE with byte_fallback, fuse_unk and <unk>, the 256 byte
                                tokens <0x00>..<0xFF>, normalizer Prepend("▁") + Replace(" ",
                                "▁"), no pre-tokenizer, <s> first (Llama 2's layout)
  gemma_style_tokenizer.json    the same model kind with normalizer Replace(" ", "▁"), no
                                pre-tokenizer, <bos> first, and non-special added tokens
                                (Gemma's layout)
  byte_fallback_expected.json   for each of those files and a few variants of them (Mistral's
                                Metaspace pre-tokenizer, the other prepend schemes, splitting,
                                unk without byte fallback, normalized added tokens): the ids of
                                every corpus line with and without special tokens, and the
                                decoded text of the ids with special tokens

Both vocabularies are trained here by `tokenizers` itself (BpeTrainer, a small alphabet so
that many characters of the corpus fall back to bytes), so nothing is downloaded. The corpus
is that of make_tokenizer_expected.py plus a few lines for these tokenizers' special tokens
and spaces. tests/engine/tokenizer_test.cc reads the files and expects Lathe's Tokenizer to
give the same ids.

Run when this script or the corpus changes (CI does not run it), with the project's virtual
environment (scripts/requirements.txt pins `tokenizers`):

  .venv/bin/python tests/engine/data/make_byte_fallback_tokenizers.py [--retrain]

By default the tokenizer files beside this script are kept and only the expected ids are
written again. --retrain trains them anew; `tokenizers`' trainer breaks ties between equally
frequent pairs in hash order, so each training gives somewhat different (equally valid)
files.
"""

import argparse
import copy
import hashlib
import importlib.util
import json
import os

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

HERE = os.path.dirname(os.path.abspath(__file__))

_spec = importlib.util.spec_from_file_location(
    'make_tokenizer_expected', os.path.join(HERE, 'make_tokenizer_expected.py'))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

CORPUS = _base.CORPUS + [
    '<s>Hello</s> world <unk> and <s> again</s>',
    '<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn><eos>',
    ' one leading space, two trailing  ',
    '\u2581already\u2581metaspace \u2581 and \u2581\u2581twice',
    '<pad><mask> <eos>x<bos> <unk><unk>',
    '\u00e9t\u00e9 \u00c9T\u00c9 na\u00efve \u00f1 \u4e16\u754c \U0001F600 \u0000',
]

# Text the vocabularies are trained on: English, for ordinary merges, and the corpus.
TRAINING_TEXT = [
    'The lathe turns the wood slowly, and the turner shapes it with a sharp gouge.',
    'A tokenizer splits text into pieces; the model learns which pieces follow which.',
    'Hello world. Hello there. The weather is fine today, and tomorrow it will rain.',
    'In the workshop there were three lathes, two saws and a long bench of tools.',
    'She said that the numbers 1, 2, 3 and 2024 were written on the board in chalk.',
] * 20 + CORPUS


def byte_tokens():
    return [f'<0x{b:02X}>' for b in range(256)]


def train(normalizer, specials, vocab_size, limit_alphabet):
    """A BPE vocabulary and merges trained on TRAINING_TEXT, with `specials` first, then the
    256 byte tokens, then the trained tokens."""
    trainer_tokenizer = Tokenizer(models.BPE(unk_token='<unk>'))
    trainer_tokenizer.normalizer = normalizer
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement='\u2581', prepend_scheme='never', split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=limit_alphabet,
                                  special_tokens=[], show_progress=False)
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    trained = json.loads(trainer_tokenizer.to_str())['model']
    vocab = {}
    for token in specials + byte_tokens():
        vocab[token] = len(vocab)
    for token, _ in sorted(trained['vocab'].items(), key=lambda item: item[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(' ')) for m in trained['merges']]
    return vocab, merges


def special(content, special_token=True):
    return tokenizers.AddedToken(content, special=special_token, normalized=False, lstrip=False,
                                 rstrip=False, single_word=False)


def llama2_style():
    normalizer = normalizers.Sequence(
        [normalizers.Prepend('\u2581'), normalizers.Replace(' ', '\u2581')])
    vocab, merges = train(normalizer, ['<unk>', '<s>', '</s>'], 900, 60)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token='<unk>',
                                     fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(' ', 1, 0)])
    tokenizer.add_special_tokens([special('<unk>'), special('<s>'), special('</s>')])
    tokenizer.post_processor = processors.TemplateProcessing(
        single='<s> $A', pair='<s> $A <s> $B', special_tokens=[('<s>', vocab['<s>'])])
    return tokenizer


def gemma_style():
    normalizer = normalizers.Replace(' ', '\u2581')
    specials = ['<pad>', '<eos>', '<bos>', '<unk>', '<mask>']
    vocab, merges = train(normalizer, specials, 800, 50)
    vocab.setdefault('<start_of_turn>', len(vocab))
    vocab.setdefault('<end_of_turn>', len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token='<unk>',
                                     fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([special(t) for t in specials])
    tokenizer.add_tokens([special('<start_of_turn>', False), special('<end_of_turn>', False)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', vocab['<bos>'])])
    return tokenizer


METASPACE_FIRST = {'type': 'Metaspace', 'replacement': '\u2581', 'prepend_scheme': 'first',
                   'split': False}


def added_tokens(vocab, tokens):
    """Added token entries with ids: a vocabulary entry's own id when there is one (BPE
    learned "<mask>" from the corpus), else the next free id."""
    next_id = max(vocab.values()) + 1
    result = []
    for token in tokens:
        entry = {'id': None, 'content': token['content'], 'single_word': False,
                 'lstrip': False, 'rstrip': False}
        entry.update(token)
        if token['content'] in vocab:
            entry['id'] = vocab[token['content']]
        else:
            entry['id'] = next_id
            next_id += 1
        result.append(entry)
    return result


def variants(vocab):
    """Each file as written, and variants with top-level or model fields replaced and added
    tokens appended."""
    return [
        {'name': 'llama2', 'file': 'llama2_style_tokenizer.json', 'patch': {}},
        {
            # Mistral v0.1's newer export (and Llama 2 conversions since tokenizers 0.19).
            'name': 'llama2-metaspace-first',
            'file': 'llama2_style_tokenizer.json',
            'patch': {'set': {'normalizer': None, 'pre_tokenizer': METASPACE_FIRST,
                              'decoder': METASPACE_FIRST}},
        },
        {
            'name': 'llama2-metaspace-always-split',
            'file': 'llama2_style_tokenizer.json',
            'patch': {'set': {
                'normalizer': None,
                'pre_tokenizer': {'type': 'Metaspace', 'replacement': '\u2581',
                                  'prepend_scheme': 'always', 'split': True},
                'decoder': {'type': 'Metaspace', 'replacement': '\u2581',
                            'prepend_scheme': 'always', 'split': True}}},
        },
        {
            'name': 'llama2-metaspace-never-nfc',
            'file': 'llama2_style_tokenizer.json',
            'patch': {'set': {
                'normalizer': {'type': 'NFC'},
                'pre_tokenizer': {'type': 'Metaspace', 'replacement': '\u2581',
                                  'prepend_scheme': 'never', 'split': True},
                'decoder': None}},
        },
        {
            'name': 'llama2-added-tokens',
            'file': 'llama2_style_tokenizer.json',
            'patch': {'append_added_tokens': added_tokens(vocab['llama2_style_tokenizer.json'], [
                {'content': '<mask>', 'lstrip': True, 'normalized': False, 'special': True},
                {'content': 'lathe', 'normalized': True, 'special': False},
                {'content': '[SEP]', 'rstrip': True, 'normalized': False, 'special': True},
                {'content': '<extra>', 'lstrip': True, 'rstrip': True, 'normalized': False,
                 'special': True},
            ])},
        },
        {'name': 'gemma', 'file': 'gemma_style_tokenizer.json', 'patch': {}},
        {
            'name': 'gemma-unk-fused',
            'file': 'gemma_style_tokenizer.json',
            'patch': {'model': {'byte_fallback': False}},
        },
        {
            'name': 'gemma-unk-unfused',
            'file': 'gemma_style_tokenizer.json',
            'patch': {'model': {'byte_fallback': False, 'fuse_unk': False}},
        },
        {
            'name': 'gemma-no-unk',
            'file': 'gemma_style_tokenizer.json',
            'patch': {'model': {'byte_fallback': False, 'unk_token': None}},
        },
    ]


def apply_patch(parsed, patch):
    result = copy.deepcopy(parsed)
    for key, value in patch.get('set', {}).items():
        result[key] = value
    for key, value in patch.get('model', {}).items():
        result['model'][key] = value
    result['added_tokens'].extend(copy.deepcopy(patch.get('append_added_tokens', [])))
    return result


def dump(value):
    return json.dumps(value, ensure_ascii=False, separators=(',', ':'))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--retrain', action='store_true',
                        help='train the tokenizer files anew instead of keeping them')
    args = parser.parse_args()
    files = {}
    for name, make in (('llama2_style_tokenizer.json', llama2_style),
                       ('gemma_style_tokenizer.json', gemma_style)):
        path = os.path.join(HERE, name)
        if args.retrain or not os.path.exists(path):
            with open(path, 'wb') as f:
                f.write(make().to_str(pretty=False).encode('utf-8') + b'\n')
        with open(path, 'rb') as f:
            files[name] = f.read()
    sha256 = {name: hashlib.sha256(text).hexdigest() for name, text in files.items()}
    parsed = {name: json.loads(text.decode('utf-8')) for name, text in files.items()}
    vocab = {name: p['model']['vocab'] for name, p in parsed.items()}

    results = []
    for variant in variants(vocab):
        patched = apply_patch(parsed[variant['file']], variant['patch'])
        tokenizer = Tokenizer.from_str(json.dumps(patched))
        for token in patched['added_tokens']:
            got = tokenizer.token_to_id(token['content'])
            if got != token['id']:
                raise SystemExit(f"{variant['name']}: {token['content']} has id {got}, "
                                 f"the file says {token['id']}")
        ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in CORPUS]
        ids_special = [tokenizer.encode(text, add_special_tokens=True).ids for text in CORPUS]
        decoded = [tokenizer.decode(i, skip_special_tokens=False) for i in ids_special]
        results.append((variant, ids, ids_special, decoded))

    lines = ['{']
    lines.append('  "generated_by": ' + dump(
        'tests/engine/data/make_byte_fallback_tokenizers.py with tokenizers '
        f'{tokenizers.__version__}') + ',')
    lines.append('  "sha256": ' + dump(sha256) + ',')
    lines.append('  "corpus": [')
    lines.append(',\n'.join('    ' + dump(text) for text in CORPUS))
    lines.append('  ],')
    lines.append('  "tokenizers": [')
    for index, (variant, ids, ids_special, decoded) in enumerate(results):
        lines.append('    {')
        lines.append(f'      "name": {dump(variant["name"])},')
        lines.append(f'      "file": {dump(variant["file"])},')
        lines.append(f'      "patch": {dump(variant["patch"])},')
        lines.append('      "ids": [')
        lines.append(',\n'.join('        ' + dump(i) for i in ids))
        lines.append('      ],')
        lines.append('      "ids_with_special_tokens": [')
        lines.append(',\n'.join('        ' + dump(i) for i in ids_special))
        lines.append('      ],')
        lines.append('      "decoded": [')
        lines.append(',\n'.join('        ' + dump(d) for d in decoded))
        lines.append('      ]')
        lines.append('    },' if index + 1 < len(results) else '    }')
    lines.append('  ]')
    lines.append('}')
    output = os.path.join(HERE, 'byte_fallback_expected.json')
    with open(output, 'w', encoding='utf-8', newline='\n') as f:
        f.write('\n'.join(lines) + '\n')
    print(f'wrote {output}: {len(results)} tokenizers x {len(CORPUS)} lines')


if __name__ == '__main__':
    main()
