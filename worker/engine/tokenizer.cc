#include "worker/engine/tokenizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <queue>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/file_util.h"
#include "common/json_fields.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/engine/pre_tokenizer.h"

namespace lathe {
namespace tokenizer_internal {

using Json = nlohmann::json;

struct AddedToken {
  std::string content;
  std::string normalized_content;  // normalized: true; what `tokenizers` decodes it to
  int64_t id = 0;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Finds added tokens as the Aho-Corasick automaton of `tokenizers` does with
// MatchKind::LeftmostLongest: the match that starts first, and of those the longest.
class AddedTokenMatcher {
 public:
  void Add(std::string pattern, const AddedToken* token) {
    auto& bucket = by_first_byte_[static_cast<unsigned char>(pattern[0])];
    bucket.push_back({std::move(pattern), token});
    std::stable_sort(bucket.begin(), bucket.end(), [](const Entry& a, const Entry& b) {
      return a.pattern.size() > b.pattern.size();
    });
  }
  bool empty() const { return by_first_byte_.empty(); }

  // The first match at or after `from`: sets [*start, *end) and *token.
  bool FindNext(absl::string_view text, size_t from, size_t* start, size_t* end,
                const AddedToken** token) const {
    for (size_t i = from; i < text.size(); ++i) {
      auto it = by_first_byte_.find(static_cast<unsigned char>(text[i]));
      if (it == by_first_byte_.end()) continue;
      for (const Entry& entry : it->second) {
        if (absl::StartsWith(text.substr(i), entry.pattern)) {
          *start = i;
          *end = i + entry.pattern.size();
          *token = entry.token;
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct Entry {
    std::string pattern;
    const AddedToken* token;
  };
  absl::flat_hash_map<unsigned char, std::vector<Entry>> by_first_byte_;
};

struct PreTokenizerStep {
  bool byte_level = false;               // else a Split
  SplitRegex regex = SplitRegex::kGpt2;  // Split
  bool add_prefix_space = false;         // ByteLevel
  bool use_regex = true;                 // ByteLevel
};

struct Merge {
  int32_t rank;
  int32_t new_id;
};

struct NormalizerStep {
  enum class Kind { kNfc, kPrepend, kReplace };
  Kind kind = Kind::kNfc;
  std::string text;     // Prepend: what is prepended; Replace: the pattern
  std::string content;  // Replace: what replaces it
};

// Metaspace's prepend_scheme.
enum class PrependScheme { kAlways, kFirst, kNever };

struct DecoderStep {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind = Kind::kFuse;
  std::string pattern;  // Replace
  std::string content;  // Replace: the replacement; Strip: the character; Metaspace: replacement
  int64_t start = 0;    // Strip
  int64_t stop = 0;     // Strip
  PrependScheme prepend_scheme = PrependScheme::kAlways;  // Metaspace
};

struct TokenizerData {
  std::vector<NormalizerStep> normalizers;
  // Byte-level BPE (a ByteLevel pre-tokenizer) or, when false, SentencePiece-style BPE
  // (no pre-tokenizer or Metaspace; characters looked up as they are, byte fallback).
  bool byte_level = true;
  std::vector<PreTokenizerStep> pre_tokenizer;  // byte-level
  bool metaspace = false;                       // SentencePiece-style: a Metaspace
  std::string metaspace_replacement;
  PrependScheme metaspace_prepend = PrependScheme::kAlways;
  bool metaspace_split = true;
  bool byte_fallback = false;
  bool fuse_unk = false;
  int32_t unk_id = -1;                      // none
  std::array<int32_t, 256> fallback_ids{};  // "<0xXX>" ids, -1 when absent
  bool has_decoder = false;                 // SentencePiece-style; byte-level ignores it
  std::vector<DecoderStep> decoder;

  absl::flat_hash_map<std::string, int32_t> vocab;        // as in the file -> id
  absl::flat_hash_map<int32_t, std::string> vocab_by_id;  // id -> as in the file
  std::array<int32_t, 256> byte_ids{};
  absl::flat_hash_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> merge
  bool ignore_merges = false;

  std::deque<AddedToken> added_tokens;  // stable addresses for the matchers
  absl::flat_hash_map<std::string, const AddedToken*> added_by_content;
  absl::flat_hash_map<int64_t, const AddedToken*> added_by_id;
  AddedTokenMatcher raw_matcher;         // normalized: false, on the raw text
  AddedTokenMatcher normalized_matcher;  // normalized: true, on the normalized text

  std::vector<int64_t> template_prefix;
  std::vector<int64_t> template_suffix;
  int64_t size = 0;

  // Words already merged, by their bytes.
  mutable absl::Mutex cache_mutex;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(cache_mutex);

  // nullopt when the normalizers make the text longer than kMaxNormalizedGrowth allows.
  std::optional<absl::string_view> Normalize(absl::string_view text, std::string* storage) const;
  absl::Status EncodeText(absl::string_view text, std::vector<int64_t>* ids) const;
  // `at_start`: the piece begins at the start of the text (Metaspace's prepend "first").
  void EncodeNormalizedPiece(absl::string_view text, bool at_start,
                             std::vector<int64_t>* ids) const;
  void EncodeMetaspace(absl::string_view text, bool at_start, std::vector<int64_t>* ids) const;
  void EncodeWord(absl::string_view bytes, std::vector<int64_t>* ids) const;
  std::vector<int32_t> InitialSymbols(absl::string_view word) const;
  std::vector<int32_t> MergeWord(std::vector<int32_t> symbols) const;
  std::string DecodeTokens(std::vector<std::string> tokens) const;
};

namespace {

constexpr size_t kMaxCachedWordBytes = 64;
constexpr size_t kMaxCacheEntries = 1 << 18;

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Sequences (of normalizers, pre-tokenizers, post-processors) nested deeper are refused:
// real files nest one level, and each level is a stack frame and a longer path.
constexpr int kMaxSequenceDepth = 8;

// One short line for a JSON value in a message.
std::string Describe(const Json& value) { return DescribeJson(value, 60); }

// A string from the file, quoted for a message as Describe shows it.
std::string Quote(absl::string_view text) { return Describe(Json(std::string(text))); }

// Decodes the code point that ends at byte `end` of valid UTF-8 `s`; sets *start to where
// it begins.
UChar32 LastCodePoint(absl::string_view s, size_t end, size_t* start) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  *start = i;
  UChar32 c;
  int32_t offset = static_cast<int32_t>(i);
  U8_NEXT_UNSAFE(reinterpret_cast<const uint8_t*>(s.data()), offset, c);
  return c;
}

UChar32 FirstCodePoint(absl::string_view s, size_t begin, size_t* next) {
  UChar32 c;
  int32_t offset = static_cast<int32_t>(begin);
  U8_NEXT_UNSAFE(reinterpret_cast<const uint8_t*>(s.data()), offset, c);
  *next = static_cast<size_t>(offset);
  return c;
}

// \w of the Rust regex crate, which `tokenizers` uses for single_word.
bool IsWordChar(UChar32 c) {
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  const uint32_t category = U_GET_GC_MASK(c);
  return (category & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

bool IsSpace(UChar32 c) { return u_isUWhiteSpace(c); }

// Calls emit(piece, token) for the pieces of `text` between added tokens (token null) and
// for each added token, as `tokenizers`' AddedVocabulary::find_matches splits.
template <typename Emit>
void SplitOnAddedTokens(const AddedTokenMatcher& matcher, absl::string_view text, Emit emit) {
  size_t start_offset = 0;  // end of what has been emitted
  size_t search_from = 0;   // the automaton resumes after each raw match
  size_t start = 0;
  size_t stop = 0;
  const AddedToken* token = nullptr;
  while (!matcher.empty() && matcher.FindNext(text, search_from, &start, &stop, &token)) {
    search_from = stop;
    if (token->single_word) {
      size_t unused;
      const bool word_before = start > 0 && IsWordChar(LastCodePoint(text, start, &unused));
      const bool word_after = stop < text.size() && IsWordChar(FirstCodePoint(text, stop, &unused));
      if (word_before || word_after) continue;
    }
    if (token->lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t char_start;
        if (!IsSpace(LastCodePoint(text, new_start, &char_start))) break;
        new_start = char_start;
      }
      start = std::max(new_start, start_offset);
    }
    if (token->rstrip) {
      while (stop < text.size()) {
        size_t next;
        if (!IsSpace(FirstCodePoint(text, stop, &next))) break;
        stop = next;
      }
    }
    if (start_offset < start) emit(text.substr(start_offset, start - start_offset), nullptr);
    emit(absl::string_view(), token);
    start_offset = stop;
  }
  if (start_offset < text.size()) emit(text.substr(start_offset), nullptr);
}

const icu::Normalizer2* NfcNormalizer() {
  static const icu::Normalizer2* const kNfc = [] {
    UErrorCode error = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(error);
    return U_SUCCESS(error) ? nfc : nullptr;
  }();
  return kNfc;
}

// NFC of valid UTF-8 `text`; `storage` holds the result when it differs.
absl::string_view Nfc(absl::string_view text, std::string* storage) {
  const icu::Normalizer2* nfc = NfcNormalizer();
  icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  UErrorCode error = U_ZERO_ERROR;
  if (nfc->isNormalizedUTF8(piece, error) && U_SUCCESS(error)) return text;
  error = U_ZERO_ERROR;
  storage->clear();
  icu::StringByteSink<std::string> sink(storage);
  nfc->normalizeUTF8(0, piece, sink, nullptr, error);
  return *storage;
}

}  // namespace

// Real normalizers grow text at most 3 times (" " to "▁", NFC); a file whose Replace steps
// double it again and again would exhaust memory.
constexpr size_t kMaxNormalizedGrowth = 16;
constexpr size_t kMaxNormalizedSlack = 1024;

std::optional<absl::string_view> TokenizerData::Normalize(absl::string_view text,
                                                          std::string* storage) const {
  if (normalizers.empty()) return text;
  const size_t limit = kMaxNormalizedGrowth * text.size() + kMaxNormalizedSlack;
  std::string current(text);
  for (const NormalizerStep& step : normalizers) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc: {
        std::string out;
        absl::string_view normalized = Nfc(current, &out);
        if (normalized.data() == out.data()) current = std::move(out);
        break;
      }
      case NormalizerStep::Kind::kPrepend:
        if (!current.empty()) current.insert(0, step.text);
        break;
      case NormalizerStep::Kind::kReplace:
        current = absl::StrReplaceAll(current, {{step.text, step.content}});
        break;
    }
    if (current.size() > limit) return std::nullopt;
  }
  *storage = std::move(current);
  return *storage;
}

absl::Status TokenizerData::EncodeText(absl::string_view text, std::vector<int64_t>* ids) const {
  bool too_long = false;
  SplitOnAddedTokens(raw_matcher, text, [&](absl::string_view piece, const AddedToken* token) {
    if (token != nullptr) {
      ids->push_back(token->id);
      return;
    }
    if (too_long) return;
    // `tokenizers` compares the piece's offset in the original text with 0.
    const bool piece_at_start = piece.data() == text.data();
    std::string storage;
    const std::optional<absl::string_view> maybe_normalized = Normalize(piece, &storage);
    if (!maybe_normalized.has_value()) {
      too_long = true;
      return;
    }
    const absl::string_view normalized = *maybe_normalized;
    SplitOnAddedTokens(normalized_matcher, normalized,
                       [&](absl::string_view inner, const AddedToken* inner_token) {
                         if (inner_token != nullptr) {
                           ids->push_back(inner_token->id);
                         } else {
                           EncodeNormalizedPiece(
                               inner, piece_at_start && inner.data() == normalized.data(), ids);
                         }
                       });
  });
  if (too_long) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tokenizer's normalizer makes the text more than ", kMaxNormalizedGrowth,
                     " times longer"));
  }
  return absl::OkStatus();
}

// Metaspace as `tokenizers` applies it: spaces become the replacement, which is put first
// (always, or for the piece at the start of the text only, unless already there), then the
// piece is split before each replacement when `split` is set.
void TokenizerData::EncodeMetaspace(absl::string_view text, bool at_start,
                                    std::vector<int64_t>* ids) const {
  if (text.empty()) return;
  std::string replaced = absl::StrReplaceAll(text, {{" ", metaspace_replacement}});
  const bool prepend = metaspace_prepend == PrependScheme::kAlways ||
                       (metaspace_prepend == PrependScheme::kFirst && at_start);
  if (prepend && !absl::StartsWith(replaced, metaspace_replacement)) {
    replaced.insert(0, metaspace_replacement);
  }
  const absl::string_view s = replaced;
  if (!metaspace_split) {
    EncodeWord(s, ids);
    return;
  }
  size_t begin = 0;
  size_t pos = 0;
  while ((pos = s.find(metaspace_replacement, pos)) != absl::string_view::npos) {
    if (pos > begin) EncodeWord(s.substr(begin, pos - begin), ids);
    begin = pos;
    pos += metaspace_replacement.size();
  }
  EncodeWord(s.substr(begin), ids);
}

void TokenizerData::EncodeNormalizedPiece(absl::string_view text, bool at_start,
                                          std::vector<int64_t>* ids) const {
  if (!byte_level) {
    if (metaspace) {
      EncodeMetaspace(text, at_start, ids);
    } else {
      EncodeWord(text, ids);
    }
    return;
  }
  std::vector<absl::string_view> pieces = {text};
  std::vector<absl::string_view> next;
  std::deque<std::string> prefixed;  // pieces that ByteLevel gave a leading space
  for (const PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    for (absl::string_view piece : pieces) {
      if (!step.byte_level) {
        SplitPreTokens(step.regex, piece, &next);
        continue;
      }
      if (step.add_prefix_space && !absl::StartsWith(piece, " ")) {
        prefixed.push_back(absl::StrCat(" ", piece));
        piece = prefixed.back();
      }
      if (step.use_regex) {
        SplitPreTokens(SplitRegex::kGpt2, piece, &next);
      } else {
        next.push_back(piece);
      }
    }
    pieces.swap(next);
  }
  for (absl::string_view word : pieces) EncodeWord(word, ids);
}

void TokenizerData::EncodeWord(absl::string_view bytes, std::vector<int64_t>* ids) const {
  if (bytes.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(byte_level ? ByteLevelEncode(bytes) : std::string(bytes));
    if (it != vocab.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (byte_level && bytes.size() == 1) {
    ids->push_back(byte_ids[static_cast<unsigned char>(bytes[0])]);
    return;
  }
  const bool cacheable = bytes.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    absl::MutexLock lock(&cache_mutex);
    auto it = cache.find(bytes);
    if (it != cache.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> merged = MergeWord(InitialSymbols(bytes));
  ids->insert(ids->end(), merged.begin(), merged.end());
  if (cacheable) {
    absl::MutexLock lock(&cache_mutex);
    if (cache.size() < kMaxCacheEntries) cache.emplace(std::string(bytes), std::move(merged));
  }
}

// The symbols BPE starts from. Byte-level: one per byte. SentencePiece-style, as `tokenizers`'
// BPE::merge_word: one per character in the vocabulary; a character that is not is its
// UTF-8 bytes' "<0xXX>" tokens with byte fallback (when all exist), else unk (consecutive
// unknowns one unk with fuse_unk), else nothing. An unk waits for the next known character,
// so byte tokens met meanwhile come before it, as there.
std::vector<int32_t> TokenizerData::InitialSymbols(absl::string_view word) const {
  std::vector<int32_t> symbols;
  if (byte_level) {
    symbols.reserve(word.size());
    for (char c : word) symbols.push_back(byte_ids[static_cast<unsigned char>(c)]);
    return symbols;
  }
  bool unk_pending = false;
  size_t pos = 0;
  while (pos < word.size()) {
    size_t next;
    FirstCodePoint(word, pos, &next);
    const absl::string_view character = word.substr(pos, next - pos);
    pos = next;
    if (auto it = vocab.find(character); it != vocab.end()) {
      if (unk_pending) symbols.push_back(unk_id);
      unk_pending = false;
      symbols.push_back(it->second);
      continue;
    }
    if (byte_fallback && std::all_of(character.begin(), character.end(), [&](char c) {
          return fallback_ids[static_cast<unsigned char>(c)] >= 0;
        })) {
      for (char c : character) symbols.push_back(fallback_ids[static_cast<unsigned char>(c)]);
      continue;
    }
    if (unk_id < 0) continue;
    if (unk_pending && !fuse_unk) symbols.push_back(unk_id);
    unk_pending = true;
  }
  if (unk_pending) symbols.push_back(unk_id);
  return symbols;
}

// Rank-ordered merging as `tokenizers`' Word::merge_all: a min-heap of candidate merges by
// (rank, position); an entry is skipped when its pair no longer gives the same token.
std::vector<int32_t> TokenizerData::MergeWord(std::vector<int32_t> initial) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  const int32_t n = static_cast<int32_t>(initial.size());
  if (n == 0) return initial;
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i) symbols[i] = {initial[i], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges.find(PairKey(symbols[pos].id, symbols[next].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& symbol = symbols[top.pos];
    if (!symbol.alive || symbol.next < 0) continue;
    const int32_t right = symbol.next;
    auto it = merges.find(PairKey(symbol.id, symbols[right].id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;
    symbol.id = top.new_id;
    symbols[right].alive = false;
    symbol.next = symbols[right].next;
    if (symbol.next >= 0) symbols[symbol.next].prev = top.pos;
    if (symbol.prev >= 0) push_pair(symbol.prev);
    push_pair(top.pos);
  }
  std::vector<int32_t> ids;
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  return ids;
}

// The decoder of SentencePiece-style BPE, step by step over the tokens as `tokenizers`'
// decode_chain, then joined; no decoder joins them with spaces, as there. Unlike there,
// ByteFallback keeps bytes that are not valid UTF-8 as they are (no U+FFFD), since Decode
// gives the bytes the ids stand for.
std::string TokenizerData::DecodeTokens(std::vector<std::string> tokens) const {
  if (!has_decoder) return absl::StrJoin(tokens, " ");
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (const DecoderStep& step : decoder) {
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        for (std::string& token : tokens) {
          token = absl::StrReplaceAll(token, {{step.pattern, step.content}});
        }
        break;
      case DecoderStep::Kind::kByteFallback: {
        std::vector<std::string> out;
        std::string bytes;
        bool in_bytes = false;
        for (std::string& token : tokens) {
          const bool is_byte = token.size() == 6 && absl::StartsWith(token, "<0x") &&
                               token[5] == '>' && hex(token[3]) >= 0 && hex(token[4]) >= 0;
          if (is_byte) {
            bytes.push_back(static_cast<char>(hex(token[3]) * 16 + hex(token[4])));
            in_bytes = true;
            continue;
          }
          if (in_bytes) out.push_back(std::move(bytes));
          bytes.clear();
          in_bytes = false;
          out.push_back(std::move(token));
        }
        if (in_bytes) out.push_back(std::move(bytes));
        tokens = std::move(out);
        break;
      }
      case DecoderStep::Kind::kFuse:
        tokens = {absl::StrJoin(tokens, "")};
        break;
      case DecoderStep::Kind::kStrip:
        for (std::string& token : tokens) {
          const absl::string_view c = step.content;
          absl::string_view rest = token;
          for (int64_t i = 0; i < step.start && absl::ConsumePrefix(&rest, c); ++i) {
          }
          for (int64_t i = 0; i < step.stop && absl::ConsumeSuffix(&rest, c); ++i) {
          }
          token = std::string(rest);
        }
        break;
      case DecoderStep::Kind::kMetaspace:
        // The first token loses every replacement (unless prepend_scheme is "never"); the
        // others have it as a space.
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && step.prepend_scheme != PrependScheme::kNever;
          tokens[i] = absl::StrReplaceAll(tokens[i], {{step.content, drop ? "" : " "}});
        }
        break;
    }
  }
  return absl::StrJoin(tokens, "");
}

namespace {

// Reads tokenizer.json into TokenizerData. Errors are "<source>: <path>: <problem>".
class TokenizerParser {
 public:
  TokenizerParser(absl::string_view source, TokenizerData* data) : source_(source), data_(data) {}

  absl::Status Parse(const Json& root) {
    if (!root.is_object()) return Error("", "expected a JSON object at the top level");
    for (const char* key : {"truncation", "padding"}) {
      auto it = root.find(key);
      if (it != root.end() && !it->is_null()) {
        return Error(key, absl::StrCat(Describe(*it),
                                       " is not supported (Lathe cuts sequences to data.seq_len "
                                       "itself); it must be null"));
      }
    }
    LATHE_RETURN_IF_ERROR(ParseNormalizer(Get(root, "normalizer"), "normalizer"));
    // No pre-tokenizer or a Metaspace: SentencePiece-style BPE (Llama 2, Mistral, Gemma).
    const Json& pre_tokenizer = Get(root, "pre_tokenizer");
    if (pre_tokenizer.is_null()) {
      data_->byte_level = false;
    } else if (pre_tokenizer.is_object() && Get(pre_tokenizer, "type") == "Metaspace") {
      data_->byte_level = false;
      data_->metaspace = true;
      LATHE_RETURN_IF_ERROR(ParseMetaspace(pre_tokenizer, "pre_tokenizer",
                                           &data_->metaspace_replacement, &data_->metaspace_prepend,
                                           &data_->metaspace_split));
    } else {
      LATHE_RETURN_IF_ERROR(ParsePreTokenizer(pre_tokenizer, "pre_tokenizer"));
      const PreTokenizerStep* last =
          data_->pre_tokenizer.empty() ? nullptr : &data_->pre_tokenizer.back();
      const int64_t byte_levels =
          std::count_if(data_->pre_tokenizer.begin(), data_->pre_tokenizer.end(),
                        [](const PreTokenizerStep& s) { return s.byte_level; });
      if (last == nullptr || !last->byte_level || byte_levels != 1) {
        return Error("pre_tokenizer",
                     "byte-level BPE needs exactly one ByteLevel pre-tokenizer, as the last one");
      }
    }
    LATHE_RETURN_IF_ERROR(ParseModel(Get(root, "model"), "model"));
    LATHE_RETURN_IF_ERROR(ParseAddedTokens(Get(root, "added_tokens"), "added_tokens"));
    LATHE_RETURN_IF_ERROR(ParsePostProcessor(Get(root, "post_processor"), "post_processor"));
    // Byte-level BPE decodes by its byte alphabet, whatever the decoder says.
    if (!data_->byte_level) {
      const Json& decoder = Get(root, "decoder");
      data_->has_decoder = !decoder.is_null();
      LATHE_RETURN_IF_ERROR(ParseDecoder(decoder, "decoder"));
    }
    return absl::OkStatus();
  }

 private:
  static const Json& Get(const Json& object, const char* key) {
    static const Json* const kNull = new Json(nullptr);
    auto it = object.find(key);
    return it == object.end() ? *kNull : *it;
  }

  absl::Status Error(absl::string_view path, absl::string_view problem) const {
    if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(source_, ": ", problem));
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", path, ": ", problem));
  }

  // The "type" of the object at `path`.
  absl::StatusOr<std::string> TypeOf(const Json& value, absl::string_view path) const {
    if (!value.is_object()) {
      return Error(path, absl::StrCat("expected an object, got ", Describe(value)));
    }
    const Json& type = Get(value, "type");
    if (type.is_null()) return Error(absl::StrCat(path, ".type"), "required field is missing");
    if (!type.is_string()) {
      return Error(absl::StrCat(path, ".type"),
                   absl::StrCat("expected a string, got ", Describe(type)));
    }
    return type.get<std::string>();
  }

  absl::StatusOr<bool> Bool(const Json& object, const char* key, bool fallback,
                            absl::string_view path) const {
    const Json& value = Get(object, key);
    if (value.is_null()) return fallback;
    if (!value.is_boolean()) {
      return Error(absl::StrCat(path, ".", key),
                   absl::StrCat("expected true or false, got ", Describe(value)));
    }
    return value.get<bool>();
  }

  absl::Status CheckSequenceDepth(absl::string_view path, int depth) const {
    if (depth < kMaxSequenceDepth) return absl::OkStatus();
    return Error(path, absl::StrCat("a Sequence nested more than ", kMaxSequenceDepth,
                                    " deep is not supported"));
  }

  absl::Status Unsupported(absl::string_view path, const Json& value,
                           absl::string_view supported) const {
    return Error(path, absl::StrCat(Describe(value), " is not supported (", supported, ")"));
  }

  // A string field; `non_empty` refuses "".
  absl::StatusOr<std::string> String(const Json& object, const char* key, absl::string_view path,
                                     bool non_empty) const {
    const Json& value = Get(object, key);
    const std::string field = absl::StrCat(path, ".", key);
    if (value.is_null()) return Error(field, "required field is missing");
    if (!value.is_string() || (non_empty && value.get<std::string>().empty())) {
      return Error(field, absl::StrCat("expected a ", non_empty ? "non-empty " : "", "string, got ",
                                       Describe(value)));
    }
    return value.get<std::string>();
  }

  // One character, as `tokenizers` requires of Metaspace's replacement and Strip's content.
  absl::StatusOr<std::string> Character(const Json& object, const char* key,
                                        absl::string_view path) const {
    LATHE_ASSIGN_OR_RETURN(std::string text, String(object, key, path, true));
    size_t next;
    if (FindInvalidUtf8(text).has_value() ||
        (FirstCodePoint(text, 0, &next), next != text.size())) {
      return Error(absl::StrCat(path, ".", key),
                   absl::StrCat("expected one character, got ", Quote(text)));
    }
    return text;
  }

  // A Replace's {"String": ...} pattern (a {"Regex": ...} is refused).
  absl::StatusOr<std::string> StringPattern(const Json& value, absl::string_view path) const {
    const Json& pattern = Get(value, "pattern");
    const std::string field = absl::StrCat(path, ".pattern");
    if (!pattern.is_object() || pattern.size() != 1 || !Get(pattern, "String").is_string() ||
        Get(pattern, "String").get<std::string>().empty()) {
      return Error(field, absl::StrCat(Describe(pattern),
                                       " is not supported (a non-empty {\"String\": ...} only)"));
    }
    return pattern["String"].get<std::string>();
  }

  // Metaspace's fields, for the pre-tokenizer and the decoder alike, as `tokenizers` reads
  // them: prepend_scheme (default "always"); the older add_prefix_space false means "never"
  // and is refused beside another scheme; split (default true).
  absl::Status ParseMetaspace(const Json& value, absl::string_view path, std::string* replacement,
                              PrependScheme* scheme, bool* split) const {
    LATHE_ASSIGN_OR_RETURN(*replacement, Character(value, "replacement", path));
    const Json& prepend = Get(value, "prepend_scheme");
    if (prepend.is_null()) {
      *scheme = PrependScheme::kAlways;
    } else if (prepend == "always") {
      *scheme = PrependScheme::kAlways;
    } else if (prepend == "first") {
      *scheme = PrependScheme::kFirst;
    } else if (prepend == "never") {
      *scheme = PrependScheme::kNever;
    } else {
      return Unsupported(absl::StrCat(path, ".prepend_scheme"), prepend,
                         "\"always\", \"first\" or \"never\" only");
    }
    LATHE_ASSIGN_OR_RETURN(bool add_prefix_space, Bool(value, "add_prefix_space", true, path));
    if (!add_prefix_space) {
      if (*scheme != PrependScheme::kNever && !prepend.is_null()) {
        return Error(absl::StrCat(path, ".add_prefix_space"),
                     "false does not match prepend_scheme (tokenizers refuses it too)");
      }
      if (prepend.is_null()) {
        return Error(absl::StrCat(path, ".add_prefix_space"),
                     "false without prepend_scheme \"never\" is not supported (tokenizers "
                     "refuses it too)");
      }
    }
    LATHE_ASSIGN_OR_RETURN(*split, Bool(value, "split", true, path));
    return absl::OkStatus();
  }

  absl::Status ParseNormalizer(const Json& value, absl::string_view path, int depth = 0) {
    if (value.is_null()) return absl::OkStatus();
    LATHE_ASSIGN_OR_RETURN(std::string type, TypeOf(value, path));
    if (type == "NFC") {
      if (NfcNormalizer() == nullptr) return absl::InternalError("ICU has no NFC normalizer");
      data_->normalizers.push_back({NormalizerStep::Kind::kNfc, "", ""});
      return absl::OkStatus();
    }
    if (type == "Prepend") {
      LATHE_ASSIGN_OR_RETURN(std::string prepend, String(value, "prepend", path, false));
      data_->normalizers.push_back({NormalizerStep::Kind::kPrepend, std::move(prepend), ""});
      return absl::OkStatus();
    }
    if (type == "Replace") {
      LATHE_ASSIGN_OR_RETURN(std::string pattern, StringPattern(value, path));
      LATHE_ASSIGN_OR_RETURN(std::string content, String(value, "content", path, false));
      data_->normalizers.push_back(
          {NormalizerStep::Kind::kReplace, std::move(pattern), std::move(content)});
      return absl::OkStatus();
    }
    if (type == "Sequence") {
      LATHE_RETURN_IF_ERROR(CheckSequenceDepth(path, depth));
      const Json& list = Get(value, "normalizers");
      if (!list.is_array()) {
        return Error(absl::StrCat(path, ".normalizers"),
                     absl::StrCat("expected a list, got ", Describe(list)));
      }
      for (size_t i = 0; i < list.size(); ++i) {
        LATHE_RETURN_IF_ERROR(
            ParseNormalizer(list[i], absl::StrCat(path, ".normalizers[", i, "]"), depth + 1));
      }
      return absl::OkStatus();
    }
    return Unsupported(absl::StrCat(path, ".type"), Get(value, "type"),
                       "null, NFC, Prepend, Replace or a Sequence of them only");
  }

  // The decoder of SentencePiece-style BPE.
  absl::Status ParseDecoder(const Json& value, absl::string_view path, int depth = 0) {
    if (value.is_null()) return absl::OkStatus();
    LATHE_ASSIGN_OR_RETURN(std::string type, TypeOf(value, path));
    DecoderStep step;
    if (type == "Sequence") {
      LATHE_RETURN_IF_ERROR(CheckSequenceDepth(path, depth));
      const Json& list = Get(value, "decoders");
      if (!list.is_array()) {
        return Error(absl::StrCat(path, ".decoders"),
                     absl::StrCat("expected a list, got ", Describe(list)));
      }
      for (size_t i = 0; i < list.size(); ++i) {
        LATHE_RETURN_IF_ERROR(
            ParseDecoder(list[i], absl::StrCat(path, ".decoders[", i, "]"), depth + 1));
      }
      return absl::OkStatus();
    } else if (type == "Replace") {
      step.kind = DecoderStep::Kind::kReplace;
      LATHE_ASSIGN_OR_RETURN(step.pattern, StringPattern(value, path));
      LATHE_ASSIGN_OR_RETURN(step.content, String(value, "content", path, false));
    } else if (type == "ByteFallback") {
      step.kind = DecoderStep::Kind::kByteFallback;
    } else if (type == "Fuse") {
      step.kind = DecoderStep::Kind::kFuse;
    } else if (type == "Strip") {
      step.kind = DecoderStep::Kind::kStrip;
      LATHE_ASSIGN_OR_RETURN(step.content, Character(value, "content", path));
      for (auto [key, field] : {std::pair<const char*, int64_t*>{"start", &step.start},
                                std::pair<const char*, int64_t*>{"stop", &step.stop}}) {
        const Json& count = Get(value, key);
        if (!count.is_number_integer() || count.get<int64_t>() < 0) {
          return Error(absl::StrCat(path, ".", key),
                       absl::StrCat("expected a count, got ", Describe(count)));
        }
        *field = count.get<int64_t>();
      }
    } else if (type == "Metaspace") {
      step.kind = DecoderStep::Kind::kMetaspace;
      bool split;
      LATHE_RETURN_IF_ERROR(
          ParseMetaspace(value, path, &step.content, &step.prepend_scheme, &split));
    } else {
      return Unsupported(
          absl::StrCat(path, ".type"), Get(value, "type"),
          "null, Replace, ByteFallback, Fuse, Strip, Metaspace or a Sequence of them only");
    }
    data_->decoder.push_back(std::move(step));
    return absl::OkStatus();
  }

  absl::Status ParsePreTokenizer(const Json& value, absl::string_view path, int depth = 0) {
    if (value.is_null()) {
      return Error(path, "null is not supported (byte-level BPE needs a ByteLevel pre-tokenizer)");
    }
    LATHE_ASSIGN_OR_RETURN(std::string type, TypeOf(value, path));
    if (type == "Sequence") {
      LATHE_RETURN_IF_ERROR(CheckSequenceDepth(path, depth));
      const Json& list = Get(value, "pretokenizers");
      if (!list.is_array()) {
        return Error(absl::StrCat(path, ".pretokenizers"),
                     absl::StrCat("expected a list, got ", Describe(list)));
      }
      for (size_t i = 0; i < list.size(); ++i) {
        LATHE_RETURN_IF_ERROR(
            ParsePreTokenizer(list[i], absl::StrCat(path, ".pretokenizers[", i, "]"), depth + 1));
      }
      return absl::OkStatus();
    }
    PreTokenizerStep step;
    if (type == "ByteLevel") {
      step.byte_level = true;
      // Hugging Face's defaults when the keys are absent.
      LATHE_ASSIGN_OR_RETURN(step.add_prefix_space, Bool(value, "add_prefix_space", true, path));
      LATHE_ASSIGN_OR_RETURN(step.use_regex, Bool(value, "use_regex", true, path));
      data_->pre_tokenizer.push_back(step);
      return absl::OkStatus();
    }
    if (type == "Split") {
      const Json& pattern = Get(value, "pattern");
      const Json& regex = pattern.is_object() ? Get(pattern, "Regex") : pattern;
      if (!pattern.is_object() || !regex.is_string()) {
        return Error(
            absl::StrCat(path, ".pattern"),
            absl::StrCat(Describe(pattern), " is not supported (a {\"Regex\": ...} only)"));
      }
      std::optional<SplitRegex> known = RecognizeSplitRegex(regex.get<std::string>());
      if (!known.has_value()) {
        return Unsupported(absl::StrCat(path, ".pattern.Regex"), regex,
                           "the GPT-2, Llama 3 and Qwen2 patterns only");
      }
      const Json& behavior = Get(value, "behavior");
      if (behavior != "Isolated") {
        return Unsupported(absl::StrCat(path, ".behavior"), behavior, "Isolated only");
      }
      LATHE_ASSIGN_OR_RETURN(bool invert, Bool(value, "invert", false, path));
      if (invert) return Unsupported(absl::StrCat(path, ".invert"), true, "false only");
      step.regex = *known;
      data_->pre_tokenizer.push_back(step);
      return absl::OkStatus();
    }
    return Unsupported(absl::StrCat(path, ".type"), Get(value, "type"),
                       "ByteLevel, Split or a Sequence of them only; Metaspace only alone");
  }

  absl::Status ParseModel(const Json& value, absl::string_view path) {
    if (value.is_null()) return Error(path, "required field is missing");
    LATHE_ASSIGN_OR_RETURN(std::string type, TypeOf(value, path));
    if (type != "BPE") {
      return Unsupported(absl::StrCat(path, ".type"), Get(value, "type"), "BPE only");
    }
    if (const Json& dropout = Get(value, "dropout"); !dropout.is_null()) {
      return Unsupported(absl::StrCat(path, ".dropout"), dropout, "must be null");
    }
    LATHE_ASSIGN_OR_RETURN(bool byte_fallback, Bool(value, "byte_fallback", false, path));
    if (byte_fallback && data_->byte_level) {
      return Unsupported(absl::StrCat(path, ".byte_fallback"), true, "byte-level BPE needs none");
    }
    data_->byte_fallback = byte_fallback;
    LATHE_ASSIGN_OR_RETURN(data_->fuse_unk, Bool(value, "fuse_unk", false, path));
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const Json& affix = Get(value, key);
      if (!affix.is_null() && affix != "") {
        return Unsupported(absl::StrCat(path, ".", key), affix, "must be null or empty");
      }
    }
    LATHE_ASSIGN_OR_RETURN(data_->ignore_merges, Bool(value, "ignore_merges", false, path));

    const std::string vocab_path = absl::StrCat(path, ".vocab");
    const Json& vocab = Get(value, "vocab");
    if (!vocab.is_object()) {
      return Error(vocab_path, absl::StrCat("expected an object, got ", Describe(vocab)));
    }
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const Json& id = it.value();
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return Error(vocab_path,
                     absl::StrCat(Quote(it.key()), ": ", Describe(id), " is not a token id"));
      }
      const int32_t token_id = id.get<int32_t>();
      // Sparse: an id is any int32, so a table indexed by id could be giant.
      auto [by_id, added] = data_->vocab_by_id.try_emplace(token_id, it.key());
      if (!added) {
        return Error(vocab_path, absl::StrCat(Quote(by_id->second), " and ", Quote(it.key()),
                                              " share id ", token_id));
      }
      data_->vocab.emplace(it.key(), token_id);
      data_->size = std::max<int64_t>(data_->size, int64_t{token_id} + 1);
    }
    if (!data_->byte_level) {
      // Byte-level BPE has every byte, so it never needs unk.
      const Json& unk = Get(value, "unk_token");
      if (!unk.is_null()) {
        auto it = unk.is_string() ? data_->vocab.find(unk.get<std::string>()) : data_->vocab.end();
        if (it == data_->vocab.end()) {
          return Error(absl::StrCat(path, ".unk_token"),
                       absl::StrCat(Describe(unk), " is not in ", vocab_path));
        }
        data_->unk_id = it->second;
      }
      for (int b = 0; b < 256; ++b) {
        auto it = data_->vocab.find(absl::StrFormat("<0x%02X>", b));
        data_->fallback_ids[b] = it == data_->vocab.end() ? -1 : it->second;
      }
    }
    const std::array<std::string, 256>& alphabet = ByteLevelAlphabet();
    for (int b = 0; b < 256 && data_->byte_level; ++b) {
      auto it = data_->vocab.find(alphabet[b]);
      if (it == data_->vocab.end()) {
        return Error(vocab_path, absl::StrCat("byte-level BPE needs all 256 byte characters; \"",
                                              alphabet[b], "\" (byte ", b, ") is missing"));
      }
      data_->byte_ids[b] = it->second;
    }

    const std::string merges_path = absl::StrCat(path, ".merges");
    const Json& merges = Get(value, "merges");
    if (!merges.is_array()) {
      return Error(merges_path, absl::StrCat("expected a list, got ", Describe(merges)));
    }
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const Json& merge = merges[rank];
      const std::string merge_path = absl::StrCat(merges_path, "[", rank, "]");
      std::string left;
      std::string right;
      if (merge.is_string()) {
        const std::string text = merge.get<std::string>();
        const size_t space = text.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == text.size() ||
            text.find(' ', space + 1) != std::string::npos) {
          return Error(merge_path, absl::StrCat("expected \"left right\", got ", Describe(merge)));
        }
        left = text.substr(0, space);
        right = text.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
                 merge[1].is_string()) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else {
        return Error(merge_path,
                     absl::StrCat("expected \"left right\" or [\"left\", \"right\"], got ",
                                  Describe(merge)));
      }
      int32_t ids[3];
      const std::string parts[3] = {left, right, left + right};
      for (int k = 0; k < 3; ++k) {
        auto it = data_->vocab.find(parts[k]);
        if (it == data_->vocab.end()) {
          return Error(merge_path, absl::StrCat(Quote(parts[k]), " is not in ", vocab_path));
        }
        ids[k] = it->second;
      }
      // A repeated pair takes its last rank, as `tokenizers` builds its map.
      data_->merges[PairKey(ids[0], ids[1])] = {static_cast<int32_t>(rank), ids[2]};
    }
    return absl::OkStatus();
  }

  absl::Status ParseAddedTokens(const Json& value, absl::string_view path) {
    if (value.is_null()) return absl::OkStatus();
    if (!value.is_array()) {
      return Error(path, absl::StrCat("expected a list, got ", Describe(value)));
    }
    for (size_t i = 0; i < value.size(); ++i) {
      const Json& entry = value[i];
      const std::string entry_path = absl::StrCat(path, "[", i, "]");
      if (!entry.is_object()) {
        return Error(entry_path, absl::StrCat("expected an object, got ", Describe(entry)));
      }
      AddedToken token;
      const Json& content = Get(entry, "content");
      if (!content.is_string() || content.get<std::string>().empty()) {
        return Error(absl::StrCat(entry_path, ".content"),
                     absl::StrCat("expected a non-empty string, got ", Describe(content)));
      }
      token.content = content.get<std::string>();
      const Json& id = Get(entry, "id");
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return Error(absl::StrCat(entry_path, ".id"),
                     absl::StrCat(Describe(id), " is not a token id"));
      }
      token.id = id.get<int64_t>();
      LATHE_ASSIGN_OR_RETURN(token.special, Bool(entry, "special", false, entry_path));
      LATHE_ASSIGN_OR_RETURN(token.single_word, Bool(entry, "single_word", false, entry_path));
      LATHE_ASSIGN_OR_RETURN(token.lstrip, Bool(entry, "lstrip", false, entry_path));
      LATHE_ASSIGN_OR_RETURN(token.rstrip, Bool(entry, "rstrip", false, entry_path));
      LATHE_ASSIGN_OR_RETURN(token.normalized,
                             Bool(entry, "normalized", !token.special, entry_path));
      if (data_->added_by_content.contains(token.content)) {
        return Error(entry_path, absl::StrCat(Quote(token.content), " is added twice"));
      }
      if (data_->added_by_id.contains(token.id)) {
        return Error(entry_path,
                     absl::StrCat("id ", token.id, " is given to ",
                                  Quote(data_->added_by_id[token.id]->content), " too"));
      }
      if (auto it = data_->vocab_by_id.find(token.id);
          it != data_->vocab_by_id.end() && it->second != token.content) {
        return Error(entry_path,
                     absl::StrCat("id ", token.id, " is ", Quote(it->second), " in model.vocab"));
      }
      if (auto it = data_->vocab.find(token.content);
          it != data_->vocab.end() && it->second != token.id) {
        return Error(entry_path, absl::StrCat(Quote(token.content), " has id ", it->second,
                                              " in model.vocab, not ", token.id));
      }
      data_->added_tokens.push_back(std::move(token));
      const AddedToken* added = &data_->added_tokens.back();
      data_->added_by_content[added->content] = added;
      data_->added_by_id[added->id] = added;
      data_->size = std::max(data_->size, added->id + 1);
    }
    // `tokenizers` tries special tokens first, then the others, each in file order; with
    // longest-match-first this order only matters between equal contents, which are refused.
    for (AddedToken& token : data_->added_tokens) {
      if (!token.normalized) {
        data_->raw_matcher.Add(token.content, &token);
        continue;
      }
      std::string storage;
      // An empty normalized form can never match.
      const std::optional<absl::string_view> normalized = data_->Normalize(token.content, &storage);
      if (!normalized.has_value()) {
        return Error("normalizer", absl::StrCat("makes ", Quote(token.content), " more than ",
                                                kMaxNormalizedGrowth, " times longer"));
      }
      token.normalized_content = std::string(*normalized);
      if (!token.normalized_content.empty()) {
        data_->normalized_matcher.Add(token.normalized_content, &token);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ParsePostProcessor(const Json& value, absl::string_view path, int depth = 0) {
    if (value.is_null()) return absl::OkStatus();
    LATHE_ASSIGN_OR_RETURN(std::string type, TypeOf(value, path));
    if (type == "ByteLevel") return absl::OkStatus();  // it only trims offsets
    if (type == "Sequence") {
      LATHE_RETURN_IF_ERROR(CheckSequenceDepth(path, depth));
      const Json& list = Get(value, "processors");
      if (!list.is_array()) {
        return Error(absl::StrCat(path, ".processors"),
                     absl::StrCat("expected a list, got ", Describe(list)));
      }
      for (size_t i = 0; i < list.size(); ++i) {
        LATHE_RETURN_IF_ERROR(
            ParsePostProcessor(list[i], absl::StrCat(path, ".processors[", i, "]"), depth + 1));
      }
      return absl::OkStatus();
    }
    if (type != "TemplateProcessing") {
      return Unsupported(absl::StrCat(path, ".type"), Get(value, "type"),
                         "null, ByteLevel, TemplateProcessing or a Sequence of them only");
    }
    const std::string single_path = absl::StrCat(path, ".single");
    const Json& single = Get(value, "single");
    if (!single.is_array()) {
      return Error(single_path, absl::StrCat("expected a list, got ", Describe(single)));
    }
    const Json& special_tokens = Get(value, "special_tokens");
    std::vector<int64_t> prefix;
    std::vector<int64_t> suffix;
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const Json& piece = single[i];
      const std::string piece_path = absl::StrCat(single_path, "[", i, "]");
      if (piece.is_object() && piece.contains("Sequence")) {
        const Json& id = Get(piece["Sequence"], "id");
        if (id != "A" || seen_sequence) {
          return Unsupported(absl::StrCat(piece_path, ".Sequence.id"), id,
                             "one sequence \"A\" only");
        }
        seen_sequence = true;
        continue;
      }
      if (!piece.is_object() || !piece.contains("SpecialToken") ||
          !Get(piece["SpecialToken"], "id").is_string()) {
        return Error(piece_path,
                     absl::StrCat("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got ",
                                  Describe(piece)));
      }
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      const Json* entry = nullptr;
      if (special_tokens.is_object() && special_tokens.contains(name)) {
        entry = &special_tokens[name];
      }
      if (entry == nullptr || !entry->is_object() || !Get(*entry, "ids").is_array()) {
        return Error(absl::StrCat(path, ".special_tokens"),
                     absl::StrCat("no ids for ", Quote(name)));
      }
      for (const Json& id : (*entry)["ids"]) {
        if (!id.is_number_integer() || !HasId(id.get<int64_t>())) {
          return Error(absl::StrCat(path, ".special_tokens[", Quote(name), "].ids"),
                       absl::StrCat(Describe(id), " is not a token id of this tokenizer"));
        }
        (seen_sequence ? suffix : prefix).push_back(id.get<int64_t>());
      }
    }
    if (!seen_sequence) return Error(single_path, "has no {\"Sequence\": {\"id\": \"A\"}}");
    // An earlier processor's tokens end up inside a later one's.
    prefix.insert(prefix.end(), data_->template_prefix.begin(), data_->template_prefix.end());
    suffix.insert(suffix.begin(), data_->template_suffix.begin(), data_->template_suffix.end());
    data_->template_prefix = std::move(prefix);
    data_->template_suffix = std::move(suffix);
    return absl::OkStatus();
  }

  // Whether model.vocab or added_tokens gives `id` (ids below size() may be unused).
  bool HasId(int64_t id) const {
    return (id >= 0 && id <= std::numeric_limits<int32_t>::max() &&
            data_->vocab_by_id.contains(static_cast<int32_t>(id))) ||
           data_->added_by_id.contains(id);
  }

  absl::string_view source_;
  TokenizerData* data_;
};

}  // namespace
}  // namespace tokenizer_internal

using tokenizer_internal::TokenizerData;

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path) {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return Parse(text, path);
}

absl::StatusOr<Tokenizer> Tokenizer::Parse(absl::string_view json_text, absl::string_view source) {
  tokenizer_internal::Json root;
  try {
    root = tokenizer_internal::Json::parse(json_text);
  } catch (const tokenizer_internal::Json::exception& e) {  // out_of_range too: 1e999
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": malformed JSON: ", PrintableAscii(e.what())));
  }
  auto data = std::make_shared<TokenizerData>();
  tokenizer_internal::TokenizerParser parser(source, data.get());
  LATHE_RETURN_IF_ERROR(parser.Parse(root));
  return Tokenizer(std::move(data));
}

absl::StatusOr<std::vector<int64_t>> Tokenizer::Encode(absl::string_view text,
                                                       bool add_special_tokens) const {
  if (std::optional<size_t> bad = FindInvalidUtf8(text); bad.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte ", *bad));
  }
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = data_->template_prefix;
  LATHE_RETURN_IF_ERROR(data_->EncodeText(text, &ids));
  if (add_special_tokens) {
    ids.insert(ids.end(), data_->template_suffix.begin(), data_->template_suffix.end());
  }
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int64_t> ids) const {
  // The inverse of ByteLevelAlphabet: every character there is below U+0200.
  static const auto* const kByteOf = [] {
    auto* byte_of = new std::array<int16_t, 0x200>();
    byte_of->fill(-1);
    const std::array<std::string, 256>& alphabet = ByteLevelAlphabet();
    for (int b = 0; b < 256; ++b) {
      size_t next;
      (*byte_of)[tokenizer_internal::FirstCodePoint(alphabet[b], 0, &next)] =
          static_cast<int16_t>(b);
    }
    return byte_of;
  }();
  std::string out;
  std::vector<std::string> tokens;  // SentencePiece-style
  for (int64_t id : ids) {
    if (auto it = data_->added_by_id.find(id); it != data_->added_by_id.end()) {
      const tokenizer_internal::AddedToken& token = *it->second;
      if (data_->byte_level) {
        out += token.content;
      } else {
        // `tokenizers` shows a normalized added token in its normalized form ("▁lathe").
        tokens.push_back(token.normalized ? token.normalized_content : token.content);
      }
      continue;
    }
    auto by_id = id < 0 || id > std::numeric_limits<int32_t>::max()
                     ? data_->vocab_by_id.end()
                     : data_->vocab_by_id.find(static_cast<int32_t>(id));
    if (by_id == data_->vocab_by_id.end()) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the tokenizer"));
    }
    const std::string& token = by_id->second;
    if (!data_->byte_level) {
      tokens.push_back(token);
      continue;
    }
    size_t pos = 0;
    while (pos < token.size()) {
      size_t next;
      UChar32 c = tokenizer_internal::FirstCodePoint(token, pos, &next);
      if (c < 0x200 && (*kByteOf)[c] >= 0) {
        out.push_back(static_cast<char>((*kByteOf)[c]));
      } else {
        out.append(token, pos, next - pos);
      }
      pos = next;
    }
  }
  if (!data_->byte_level) return data_->DecodeTokens(std::move(tokens));
  return out;
}

std::optional<int64_t> Tokenizer::TokenId(absl::string_view token) const {
  if (auto it = data_->added_by_content.find(token); it != data_->added_by_content.end()) {
    return it->second->id;
  }
  if (auto it = data_->vocab.find(token); it != data_->vocab.end()) return it->second;
  return std::nullopt;
}

int64_t Tokenizer::size() const { return data_->size; }

const std::vector<int64_t>& Tokenizer::template_prefix() const { return data_->template_prefix; }

const std::vector<int64_t>& Tokenizer::template_suffix() const { return data_->template_suffix; }

}  // namespace lathe
