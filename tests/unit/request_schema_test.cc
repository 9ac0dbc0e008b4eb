// The front door's request schema (front/request_schema.h): what reaches the decoder is only
// what the served decoder takes without misbehaving (issue 50, finding 1: a `stop` of [1]
// killed mlx-lm's generation thread, and every later request failed).
#include "front/request_schema.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace hetero {
namespace {

using nlohmann::json;

const ServedLimits kLlama{1000, 8192, "llama"};
const ServedLimits kDsv4{1000, 8192, "deepseek_v4"};
const ServedLimits kUnknown{};

// Bodies exactly as the official openai Python client (3.57.0) sends them, captured from the
// wire: chat.completions.create with common options, streaming with stream_options, a tool
// conversation, completions.create, and extra_body with mlx-lm's own fields.
const char* kClientChat =
    R"({"model":"tiny","messages":[{"role":"system","content":"You are terse."},)"
    R"({"role":"user","content":"Say hi."}],"frequency_penalty":0.2,"logit_bias":{"15":-100},)"
    R"("logprobs":true,"max_tokens":64,"n":1,"presence_penalty":0.1,"seed":42,"stop":["\n\n"],)"
    R"("temperature":0.7,"top_logprobs":3,"top_p":0.9,"user":"u1"})";
const char* kClientStream =
    R"({"model":"tiny","stream":true,"messages":[{"role":"system","content":"You are terse."},)"
    R"({"role":"user","content":"Say hi."}],"max_completion_tokens":32,)"
    R"("stream_options":{"include_usage":true}})";
const char* kClientTools =
    R"({"model":"tiny","messages":[{"role":"user","content":"Weather in Paris?"},)"
    R"({"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",)"
    R"("function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},)"
    R"({"role":"tool","tool_call_id":"call_1","content":"sunny"}],"max_tokens":16,)"
    R"("parallel_tool_calls":false,"tool_choice":"auto","tools":[{"type":"function","function":)"
    R"({"name":"get_weather","description":"Weather for a city.","parameters":{"type":"object",)"
    R"("properties":{"city":{"type":"string"}},"required":["city"]}}}]})";
const char* kClientCompletion =
    R"({"model":"tiny","prompt":"Once upon a time","echo":false,"max_tokens":16,"n":1,"seed":7,)"
    R"("stop":"\n","temperature":0})";
const char* kClientExtraBody =
    R"({"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],)"
    R"("top_k":20,"min_p":0.05,"repetition_penalty":1.1,)"
    R"("chat_template_kwargs":{"enable_thinking":false}})";

json chat_body() {
  return {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
}
json text_body() { return {{"model", "tiny"}, {"prompt", "Once"}}; }

// The refusal of `body` with `name` set to `value`, for both endpoints.
std::string error_with(const char* name, const json& value, bool chat,
                       const ServedLimits& served = kLlama) {
  json body = chat ? chat_body() : text_body();
  body[name] = value;
  return completion_request_error(body, chat, served);
}

TEST(RequestSchema, Issue50StopThatIsNotStringsIsRefusedNamingStop) {
  // Each of these reached mlx-lm's _make_state_machine, which hashes the stop list in the
  // generation thread: TypeError, the thread died, every later request failed.
  for (const char* bad : {"5", "[1]", R"([["x"]])", "[{}]", "{}", "true", "1.5", "[null]"}) {
    for (bool chat : {true, false}) {
      const std::string why = error_with("stop", json::parse(bad), chat);
      EXPECT_NE(why.find("'stop'"), std::string::npos) << bad << ": " << why;
    }
  }
  EXPECT_NE(error_with("stop", std::vector<std::string>(17, "x"), true), "");
  EXPECT_NE(error_with("stop", std::string(1025, 'x'), true), "");
  EXPECT_NE(error_with("stop", json::array({std::string(1025, 'x')}), true), "");
}

TEST(RequestSchema, StopStringsAndListsAreAccepted) {
  for (const json& ok : {json("\n"), json({"a", "b"}), json::array(), json(""), json(nullptr),
                         json(std::vector<std::string>(16, "x")), json(std::string(1024, 'x'))})
    for (bool chat : {true, false}) EXPECT_EQ(error_with("stop", ok, chat), "") << ok.dump();
}

TEST(RequestSchema, OpenAIClientBodiesAreAccepted) {
  for (const ServedLimits& served : {kLlama, kUnknown, ServedLimits{128256, 131072, "llama"}}) {
    for (const char* chat : {kClientChat, kClientStream, kClientTools, kClientExtraBody})
      EXPECT_EQ(completion_request_error(json::parse(chat), true, served), "") << chat;
    EXPECT_EQ(completion_request_error(json::parse(kClientCompletion), false, served), "");
  }
  // mlx-vlm has no stop sequences; everything else the client sends is taken.
  for (const char* chat : {kClientStream, kClientTools})
    EXPECT_EQ(completion_request_error(json::parse(chat), true, kDsv4), "") << chat;
  json no_stop = json::parse(kClientChat);
  no_stop.erase("stop");
  EXPECT_EQ(completion_request_error(no_stop, true, kDsv4), "");
}

struct Bounds {
  const char* name;
  std::vector<json> ok, bad;
};

// Boundary values of every numeric field, with a vocabulary of 1000 and a window of 8192.
const std::vector<Bounds> kBounds = {
    {"max_tokens", {1, 8192}, {0, -1, 8193, 1.5, "4", true, 18446744073709551615ull, 1e30}},
    {"max_completion_tokens", {1, 8192}, {0, 8193, 2.0, "8"}},
    {"temperature", {0, 0.0, 0.7, 2, 2.0}, {-0.01, 2.01, "1", true}},
    {"top_p", {0, 0.5, 1}, {-0.1, 1.1, "0.5"}},
    {"min_p", {0, 1}, {-0.1, 1.1}},
    {"top_k", {0, 999}, {-1, 1000, 5.0, 1e30}},
    {"repetition_penalty", {0, 1.1, 2}, {-0.1, 2.1}},
    {"presence_penalty", {-2, 0, 2}, {-2.1, 2.1, false}},
    {"frequency_penalty", {-2, 2}, {-2.1, 2.1}},
    {"repetition_context_size", {0, 20, 8192}, {-1, 8193, 20.5}},
    {"presence_context_size", {0, 8192}, {-1, 8193}},
    {"frequency_context_size", {0, 8192}, {-1, 8193}},
    {"xtc_probability", {0, 0.5, 1}, {-0.1, 1.1}},
    {"xtc_threshold", {0, 0.1, 0.5}, {0.51, 1}},  // apply_xtc raises above 0.5
    {"top_logprobs", {0, 11}, {-1, 12, 3.0}},
    {"num_draft_tokens", {0, 64}, {-1, 65}},
    {"seed", {0, 42, 9223372036854775807ll}, {-1, 9223372036854775808ull, 1e30, 1.5}},
    {"n", {1}, {0, 2, 1.0}},
};

TEST(RequestSchema, NumericFieldsAtTheirBounds) {
  for (const Bounds& b : kBounds) {
    for (bool chat : {true, false}) {
      for (const json& v : b.ok) EXPECT_EQ(error_with(b.name, v, chat), "") << b.name << "=" << v;
      for (const json& v : b.bad) {
        const std::string why = error_with(b.name, v, chat);
        EXPECT_NE(why.find(std::string("'") + b.name + "'"), std::string::npos)
            << b.name << "=" << v << ": " << why;
      }
    }
  }
}

TEST(RequestSchema, NullIsAbsentExceptWhereTheFrontReadsTheField) {
  for (const char* name : {"temperature", "max_tokens", "seed", "stop", "logit_bias", "n", "tools"})
    EXPECT_EQ(error_with(name, nullptr, true), "") << name;
  for (const char* name : {"model", "stream", "stream_options"})
    EXPECT_NE(error_with(name, nullptr, true).find(name), std::string::npos) << name;
  // The front reads stream_options.include_usage with value(), which throws on null.
  EXPECT_NE(error_with("stream_options", {{"include_usage", nullptr}}, true), "");
  EXPECT_EQ(error_with("stream_options", json::object(), true), "");
}

TEST(RequestSchema, UnknownLimitsFallBackToConservativeBounds) {
  EXPECT_EQ(error_with("top_k", 31999, true, kUnknown), "");
  EXPECT_NE(error_with("top_k", 32000, true, kUnknown), "");
  EXPECT_EQ(error_with("max_tokens", 1 << 21, true, kUnknown), "");
  EXPECT_NE(error_with("max_tokens", (1 << 21) + 1, true, kUnknown), "");
  EXPECT_EQ(completion_request_error(chat_body(), true), "");  // the overload: all unknown
  EXPECT_NE(completion_request_error(json::parse(R"({"messages":[],"top_k":1})"), true), "");
}

TEST(RequestSchema, LogitBiasKeysAreTokenIdsInTheVocabulary) {
  EXPECT_EQ(error_with("logit_bias", {{"0", 1}, {"999", -100}, {"5", 100}, {"7", 0.5}}, true), "");
  for (const json& bad : {json{{"1000", 1}}, json{{"-1", 1}}, json{{"01", 1}}, json{{"abc", 1}},
                          json{{"", 1}}, json{{"99999999999", 1}}, json{{"5", 101}},
                          json{{"5", "x"}}, json{{"5", true}}, json::array({1})}) {
    const std::string why = error_with("logit_bias", bad, true);
    EXPECT_NE(why.find("'logit_bias'"), std::string::npos) << bad << ": " << why;
  }
  json many = json::object();
  for (int i = 0; i < 301; ++i) many[std::to_string(i)] = 1;
  EXPECT_NE(error_with("logit_bias", many, true), "");
}

TEST(RequestSchema, MoreThanOneChoiceIsRefused) {
  const std::string why = error_with("n", 2, true);
  EXPECT_NE(why.find("'n' must be 1"), std::string::npos) << why;
  EXPECT_NE(why.find("one choice"), std::string::npos) << why;
  EXPECT_EQ(error_with("n", 1, true), "");
  EXPECT_NE(error_with("best_of", 2, false), "");
}

TEST(RequestSchema, CompletionLengthIsBoundedByTheContextWindow) {
  // Regression (issue 50): max_tokens 10^9 was accepted.
  json body = chat_body();
  body["max_tokens"] = 1000000000;
  const std::string why = completion_length_error(body, 10, kLlama);
  EXPECT_NE(why.find("context window is 8192"), std::string::npos) << why;
  body["max_tokens"] = 192;
  EXPECT_EQ(completion_length_error(body, 8000, kLlama), "");
  EXPECT_NE(completion_length_error(body, 8001, kLlama), "");
  // max_completion_tokens is what mlx-lm reads when both are given.
  body["max_completion_tokens"] = 100;
  EXPECT_EQ(completion_length_error(body, 8001, kLlama), "");
  body["max_completion_tokens"] = nullptr;
  EXPECT_NE(completion_length_error(body, 8001, kLlama), "");
  EXPECT_EQ(completion_length_error(chat_body(), 8191, kLlama), "");  // absent: fine
  EXPECT_EQ(completion_length_error(body, 8001, kUnknown), "");       // window unknown
  body["max_tokens"] = 18446744073709551615ull;
  EXPECT_NE(completion_length_error(body, 1, kLlama), "");
}

TEST(RequestSchema, MessagesAreTextConversations) {
  auto error_for = [](const char* messages) {
    json body = chat_body();
    body["messages"] = json::parse(messages);
    return completion_request_error(body, true, kLlama);
  };
  EXPECT_EQ(error_for(R"([{"role":"developer","content":"Be brief."},{"role":"user",)"
                      R"("content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}])"),
            "");
  EXPECT_EQ(error_for(R"([{"role":"user","content":"q"},{"role":"assistant"}])"), "");
  const std::vector<std::pair<const char*, const char*>> bad = {
      {"[]", "'messages'"},
      {"{}", "'messages'"},
      {R"(["hi"])", "'messages[0]'"},
      {R"([{"content":"x"}])", "'messages[0].role'"},
      {R"([{"role":"wizard","content":"x"}])", "'messages[0].role'"},
      {R"([{"role":"user"}])", "'messages[0].content'"},
      {R"([{"role":"user","content":5}])", "'messages[0].content'"},
      {R"([{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x"}}]}])",
       "'messages[0].content[0]'"},
      {R"([{"role":"user","content":[{"type":"text"}]}])", "'messages[0].content[0].text'"},
      {R"([{"role":"user","content":["hi"]}])", "'messages[0].content[0].type'"},
      {R"([{"role":"user","content":"x","name":5}])", "'messages[0].name'"},
      {R"([{"role":"user","content":"x","tool_calls":[]}])", "'messages[0].tool_calls'"},
      {R"([{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{"}}]}])",
       "'messages[0].tool_calls[0].function.arguments'"},
      {R"([{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"[1]"}}]}])",
       "'messages[0].tool_calls[0].function.arguments'"},
      {R"([{"role":"assistant","tool_calls":[{"function":{}}]}])",
       "'messages[0].tool_calls[0].function.name'"},
  };
  for (const auto& [messages, named] : bad) {
    const std::string why = error_for(messages);
    EXPECT_NE(why.find(named), std::string::npos) << messages << ": " << why;
  }
  json many = chat_body();
  many["messages"] = json::array();
  for (int i = 0; i < 4097; ++i) many["messages"].push_back({{"role", "user"}, {"content", "x"}});
  EXPECT_NE(completion_request_error(many, true, kLlama), "");
}

TEST(RequestSchema, ToolsAndTemplateArguments) {
  EXPECT_NE(error_with("tools", json::parse(R"([{"type":"function"}])"), true), "");
  EXPECT_NE(error_with("tools", json::parse(R"([{"type":"x","function":{"name":"f"}}])"), true),
            "");
  EXPECT_NE(
      error_with("tools", json::parse(R"([{"type":"function","function":{"name":""}}])"), true),
      "");
  EXPECT_EQ(error_with("chat_template_kwargs", {{"enable_thinking", false}}, true), "");
  // apply_chat_template's own arguments would change what tokenization returns.
  for (const char* reserved : {"tokenize", "return_dict", "add_generation_prompt", "tools"})
    EXPECT_NE(error_with("chat_template_kwargs", {{reserved, false}}, true).find(reserved),
              std::string::npos);
  EXPECT_NE(error_with("chat_template_kwargs", {{"x", {{"y", 1}}}}, true), "");
  EXPECT_NE(error_with("chat_template_kwargs", {{"not an identifier", 1}}, true), "");
  EXPECT_NE(error_with("role_mapping", {{"user", 5}}, true), "");
  EXPECT_NE(error_with("draft_model", "other/model", true), "");
  EXPECT_EQ(error_with("draft_model", "default_model", true), "");
  EXPECT_NE(error_with("adapters", "/tmp/evil", true), "");
  EXPECT_NE(error_with("functions", json::array(), true), "");
}

TEST(RequestSchema, TheFamilyDecidesWhatIsHonoured) {
  // mlx-vlm serves chat only, has no stop sequences, and has structured output.
  EXPECT_NE(completion_request_error(text_body(), false, kDsv4), "");
  EXPECT_NE(error_with("stop", "\n", true, kDsv4).find("'stop'"), std::string::npos);
  EXPECT_EQ(error_with("stop", json::array(), true, kDsv4), "");
  const json schema = {{"type", "json_schema"},
                       {"json_schema", {{"name", "x"}, {"schema", {{"type", "object"}}}}}};
  EXPECT_EQ(error_with("response_format", schema, true, kDsv4), "");
  EXPECT_NE(error_with("response_format", {{"type", "json_schema"}}, true, kDsv4), "");
  EXPECT_NE(error_with("response_format", schema, true, kLlama), "");
  EXPECT_EQ(error_with("response_format", {{"type", "text"}}, true, kLlama), "");
  EXPECT_EQ(error_with("tool_choice", "required", true, kDsv4), "");
  EXPECT_NE(error_with("tool_choice", "required", true, kLlama), "");
  EXPECT_EQ(error_with("tool_choice", "none", true, kLlama), "");
  EXPECT_NE(error_with("tool_choice", "sometimes", true, kDsv4), "");
}

TEST(RequestSchema, PromptIsOneNonEmptyString) {
  for (const json& bad : {json(""), json({"a", "b"}), json({1, 2}), json(5), json(nullptr)})
    EXPECT_NE(error_with("prompt", bad, false).find("'prompt'"), std::string::npos) << bad;
  json no_prompt = text_body();
  no_prompt.erase("prompt");
  EXPECT_NE(completion_request_error(no_prompt, false, kLlama), "");
  EXPECT_NE(error_with("echo", true, false), "");
  EXPECT_NE(error_with("suffix", "end", false), "");
  EXPECT_EQ(completion_request_error(json::array(), true, kLlama),
            "the request body must be a JSON object");
}

TEST(RequestSchema, ForwardedBodyHoldsOnlyWhatTheDecoderReads) {
  for (const char* client : {kClientChat, kClientStream, kClientTools, kClientExtraBody}) {
    json body = json::parse(client);
    json expected = body;
    for (const char* dropped : {"n", "user", "parallel_tool_calls"}) expected.erase(dropped);
    expected.erase("tool_choice");  // "auto": what mlx-lm does anyway
    body["cache_salt"] = "tenant-a";
    body["some_future_field"] = {{"x", 1}};
    body["top_n_sigma"] = 1.0;
    body["temperature"] = nullptr;  // null: absent
    expected.erase("temperature");
    body["messages"][0]["unknown"] = 5;
    EXPECT_EQ(forwarded_completion_body(body, true, kLlama), expected) << client;
  }
  json text = json::parse(kClientCompletion);
  json expected = text;
  for (const char* dropped : {"n", "echo"}) expected.erase(dropped);
  text["cache_salt"] = "s";
  text["messages"] = "ignored on /v1/completions";
  EXPECT_EQ(forwarded_completion_body(text, false, kLlama), expected);
}

TEST(RequestSchema, ForwardedBodyStatesWhatEachDecoderReadsTheSameWay) {
  json body = chat_body();
  body["xtc_probability"] = 0;              // mlx-lm refuses an integer here
  body["stream_options"] = json::object();  // mlx-lm indexes include_usage when streaming
  body["tools"] = json::parse(R"([{"type":"function","function":{"name":"f","x":1},"y":2}])");
  body["tool_choice"] = "none";
  json out = forwarded_completion_body(body, true, kLlama);
  EXPECT_TRUE(out["xtc_probability"].is_number_float());
  EXPECT_EQ(out["stream_options"], json({{"include_usage", false}}));
  EXPECT_FALSE(out.contains("tools"));  // "none": the template never sees them
  EXPECT_FALSE(out.contains("tool_choice"));

  body["tool_choice"] = "auto";
  body["max_completion_tokens"] = 7;
  body["enable_thinking"] = false;
  out = forwarded_completion_body(body, true, kDsv4);
  EXPECT_EQ(out["max_tokens"], 7);  // mlx-vlm reads only max_tokens
  EXPECT_FALSE(out.contains("max_completion_tokens"));
  EXPECT_FALSE(out.contains("xtc_probability"));
  EXPECT_EQ(out["tool_choice"], "auto");
  EXPECT_EQ(out["enable_thinking"], false);
  EXPECT_EQ(out["tools"], json::parse(R"([{"type":"function","function":{"name":"f"}}])"));
}

TEST(RequestSchema, ServedLimitsComeFromTheDecodersInfo) {
  const ServedLimits s = served_limits(
      {{"vocab_size", 128256}, {"context_window", 131072}, {"family", "llama"}, {"x", 1}});
  EXPECT_EQ(s.vocab_size, 128256);
  EXPECT_EQ(s.context_window, 131072);
  EXPECT_EQ(s.family, "llama");
  const ServedLimits none = served_limits({{"vocab_size", "big"}, {"context_window", nullptr}});
  EXPECT_EQ(none.vocab_size, 0);
  EXPECT_EQ(none.context_window, 0);
  EXPECT_EQ(served_limits(json::array()).family, "");
}

}  // namespace
}  // namespace hetero
