#include "worker/engine/pre_tokenizer.h"

#include <unicode/uchar.h>

#include <cstdint>

namespace lathe {
namespace {

constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Character classes the patterns test. A character with none of them is what the patterns
// call [^\s\p{L}\p{N}].
enum : uint8_t {
  kLetter = 1,   // \p{L}
  kNumber = 2,   // \p{N}
  kSpace = 4,    // \s: White_Space
  kNewline = 8,  // [\r\n] (also kSpace)
};

uint8_t ClassOf(char32_t c) {
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return kLetter;
    if (c >= '0' && c <= '9') return kNumber;
    if (c == '\r' || c == '\n') return kSpace | kNewline;
    if (c == ' ' || c == '\t' || c == '\v' || c == '\f') return kSpace;
    return 0;
  }
  const uint32_t category = U_GET_GC_MASK(static_cast<UChar32>(c));
  uint8_t cls = 0;
  if (category & U_GC_L_MASK) cls |= kLetter;
  if (category & U_GC_N_MASK) cls |= kNumber;
  if (u_isUWhiteSpace(static_cast<UChar32>(c))) cls |= kSpace;
  return cls;
}

// Decodes one code point of valid UTF-8 at `s`; sets `*length` to its byte count.
char32_t DecodeUtf8(const unsigned char* s, size_t* length) {
  if (s[0] < 0x80) {
    *length = 1;
    return s[0];
  }
  if (s[0] < 0xE0) {
    *length = 2;
    return ((s[0] & 0x1F) << 6) | (s[1] & 0x3F);
  }
  if (s[0] < 0xF0) {
    *length = 3;
    return ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F);
  }
  *length = 4;
  return ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

// The text as code points with their classes and byte offsets (offset[n] = text size).
struct DecodedText {
  std::vector<char32_t> chars;
  std::vector<uint8_t> classes;
  std::vector<size_t> offsets;

  explicit DecodedText(absl::string_view text) {
    chars.reserve(text.size());
    classes.reserve(text.size());
    offsets.reserve(text.size() + 1);
    const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
    size_t pos = 0;
    while (pos < text.size()) {
      size_t length = 1;
      char32_t c = DecodeUtf8(bytes + pos, &length);
      chars.push_back(c);
      classes.push_back(ClassOf(c));
      offsets.push_back(pos);
      pos += length;
    }
    offsets.push_back(text.size());
  }
  size_t size() const { return chars.size(); }
};

// Case folding as Oniguruma's (?i:...) applies it to the contraction letters: ASCII case,
// and U+017F LATIN SMALL LETTER LONG S, which folds to 's'.
char32_t FoldContractionLetter(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c - 'A' + 'a';
  if (c == 0x017F) return 's';
  return c;
}

// Length 2 or 3 of the contraction ('s 't 're 've 'm 'll 'd) at `i`, or 0.
size_t ContractionLength(const DecodedText& t, size_t i, bool ignore_case) {
  const size_t n = t.size();
  if (t.chars[i] != '\'' || i + 1 >= n) return 0;
  auto letter = [&](size_t k) {
    return ignore_case ? FoldContractionLetter(t.chars[k]) : t.chars[k];
  };
  const char32_t a = letter(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= n) return 0;
  const char32_t b = letter(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

bool IsOther(uint8_t cls) { return (cls & (kLetter | kNumber | kSpace)) == 0; }

// End of the run of characters from `i` whose class satisfies `in_run`.
template <typename Predicate>
size_t RunEnd(const DecodedText& t, size_t i, Predicate in_run) {
  while (i < t.size() && in_run(t.classes[i])) ++i;
  return i;
}

// \s+(?!\S)|\s+ at `i` (a space), given the end `k` of the whitespace run: all of it at
// the end of the text or when it is one character, else all but its last character (which
// then starts the next piece, e.g. " word").
size_t TrailingSpaceEnd(const DecodedText& t, size_t i, size_t k) {
  return (k == t.size() || k - i == 1) ? k : k - 1;
}

// End of the GPT-2 match at `i`.
size_t MatchGpt2(const DecodedText& t, size_t i) {
  if (size_t length = ContractionLength(t, i, /*ignore_case=*/false)) return i + length;
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: the three classes are disjoint, so the
  // alternative is the class of the first character after an optional space.
  size_t j = i;
  if (t.chars[i] == ' ' && i + 1 < t.size() && !(t.classes[i + 1] & kSpace)) j = i + 1;
  const uint8_t first = t.classes[j];
  if (!(first & kSpace)) {
    if (first & kLetter) return RunEnd(t, j, [](uint8_t c) { return (c & kLetter) != 0; });
    if (first & kNumber) return RunEnd(t, j, [](uint8_t c) { return (c & kNumber) != 0; });
    return RunEnd(t, j, IsOther);
  }
  const size_t k = RunEnd(t, i, [](uint8_t c) { return (c & kSpace) != 0; });
  return TrailingSpaceEnd(t, i, k);
}

// End of the Llama 3 (max_digits 3) or Qwen2 (max_digits 1) match at `i`.
size_t MatchLlama3(const DecodedText& t, size_t i, size_t max_digits) {
  const size_t n = t.size();
  if (size_t length = ContractionLength(t, i, /*ignore_case=*/true)) return i + length;
  auto is_letter = [](uint8_t c) { return (c & kLetter) != 0; };
  const uint8_t cls = t.classes[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (cls & kLetter) return RunEnd(t, i, is_letter);
  if (!(cls & (kNewline | kNumber)) && i + 1 < n && (t.classes[i + 1] & kLetter)) {
    return RunEnd(t, i + 1, is_letter);
  }
  // \p{N}{1,max_digits}
  if (cls & kNumber) {
    size_t k = i + 1;
    while (k < n && k - i < max_digits && (t.classes[k] & kNumber)) ++k;
    return k;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  size_t j = i;
  if (t.chars[i] == ' ' && i + 1 < n && IsOther(t.classes[i + 1])) j = i + 1;
  if (IsOther(t.classes[j])) {
    size_t k = RunEnd(t, j, IsOther);
    return RunEnd(t, k, [](uint8_t c) { return (c & kNewline) != 0; });
  }
  // Whitespace from here on. \s*[\r\n]+ ends after the run's last newline, if it has one.
  const size_t k = RunEnd(t, i, [](uint8_t c) { return (c & kSpace) != 0; });
  for (size_t m = k; m > i; --m) {
    if (t.classes[m - 1] & kNewline) return m;
  }
  return TrailingSpaceEnd(t, i, k);
}

}  // namespace

absl::string_view SplitRegexPattern(SplitRegex regex) {
  switch (regex) {
    case SplitRegex::kGpt2:
      return kGpt2Pattern;
    case SplitRegex::kLlama3:
      return kLlama3Pattern;
    case SplitRegex::kQwen2:
      return kQwen2Pattern;
  }
  return "";
}

absl::string_view SplitRegexName(SplitRegex regex) {
  switch (regex) {
    case SplitRegex::kGpt2:
      return "GPT-2";
    case SplitRegex::kLlama3:
      return "Llama 3";
    case SplitRegex::kQwen2:
      return "Qwen2";
  }
  return "";
}

std::optional<SplitRegex> RecognizeSplitRegex(absl::string_view pattern) {
  for (SplitRegex regex : {SplitRegex::kGpt2, SplitRegex::kLlama3, SplitRegex::kQwen2}) {
    if (pattern == SplitRegexPattern(regex)) return regex;
  }
  return std::nullopt;
}

void SplitPreTokens(SplitRegex regex, absl::string_view text,
                    std::vector<absl::string_view>* pieces) {
  const DecodedText t(text);
  size_t i = 0;
  while (i < t.size()) {
    size_t end = regex == SplitRegex::kGpt2     ? MatchGpt2(t, i)
                 : regex == SplitRegex::kLlama3 ? MatchLlama3(t, i, 3)
                                                : MatchLlama3(t, i, 1);
    pieces->push_back(text.substr(t.offsets[i], t.offsets[end] - t.offsets[i]));
    i = end;
  }
}

std::optional<size_t> FindInvalidUtf8(absl::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    char32_t min;
    char32_t c;
    if (b >= 0xC2 && b <= 0xDF) {
      length = 2;
      min = 0x80;
      c = b & 0x1F;
    } else if (b >= 0xE0 && b <= 0xEF) {
      length = 3;
      min = 0x800;
      c = b & 0x0F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      length = 4;
      min = 0x10000;
      c = b & 0x07;
    } else {
      return i;
    }
    if (n - i < length) return i;
    for (size_t k = 1; k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      c = (c << 6) | (s[i + k] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return i;
    i += length;
  }
  return std::nullopt;
}

const std::array<std::string, 256>& ByteLevelAlphabet() {
  static const auto* const kAlphabet = [] {
    auto* alphabet = new std::array<std::string, 256>();
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool shown_as_itself =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = shown_as_itself ? b : 0x100 + next_extra++;
      std::string& utf8 = (*alphabet)[b];
      if (c < 0x80) {
        utf8.push_back(static_cast<char>(c));
      } else {  // every character here is below U+0800
        utf8.push_back(static_cast<char>(0xC0 | (c >> 6)));
        utf8.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
    }
    return alphabet;
  }();
  return *kAlphabet;
}

std::string ByteLevelEncode(absl::string_view bytes) {
  const std::array<std::string, 256>& alphabet = ByteLevelAlphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) out += alphabet[static_cast<unsigned char>(b)];
  return out;
}

}  // namespace lathe
