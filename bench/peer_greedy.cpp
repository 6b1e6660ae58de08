// Greedy decoding through llama.cpp's C API, for bench/peer.py: tokens to check against our
// engine, and the time each phase takes, measured the way bench/peer.py measures ours.
//
// usage: peer_greedy MODEL.gguf THREADS N_PREDICT REPEATS ID,ID,...
// Prints one JSON object: the prompt's greedy continuation (token ids); per generated token
// the margin between its logit and the runner-up's, so that a disagreement with our engine
// can be told apart from a near-tie that summation order may flip; and per repeat the
// prompt's time (to the first token) and the mean time of each later token. The KV cache is
// fp32 and flash attention off, as in our engine's fp32 runs (llama-bench cannot set an fp32
// cache). Every repeat starts from an empty cache; the first is a warm-up and not reported.

#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

struct Run {
    std::vector<llama_token> tokens;
    std::vector<float> margins;
    double prefill_ms = 0.0;
    double decode_ms_per_token = 0.0;
};

static double ms_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
}

static bool run_once(llama_context * ctx, int n_vocab, std::vector<llama_token> prompt,
                     int n_predict, Run & run) {
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
    llama_token next = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < n_predict; ++step) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed at step %d\n", step);
            return false;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0, second = -1;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > logits[best]) {
                second = best;
                best = v;
            } else if (second < 0 || logits[v] > logits[second]) {
                second = v;
            }
        }
        if (step == 0) {
            run.prefill_ms = ms_since(start);
        }
        next = best;
        run.tokens.push_back(next);
        run.margins.push_back(logits[best] - logits[second]);
        batch = llama_batch_get_one(&next, 1);
    }
    const double total_ms = ms_since(start);
    run.decode_ms_per_token = n_predict > 1 ? (total_ms - run.prefill_ms) / (n_predict - 1) : 0;
    return true;
}

template <typename T> static void print_list(const char * key, const std::vector<T> & values,
                                             const char * fmt, bool last) {
    printf("\"%s\": [", key);
    for (size_t i = 0; i < values.size(); ++i) {
        printf(i ? ", " : "");
        printf(fmt, values[i]);
    }
    printf(last ? "]" : "], ");
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS N_PREDICT REPEATS ID,ID,...\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]);
    const int n_predict = atoi(argv[3]);
    const int repeats = atoi(argv[4]);
    std::vector<llama_token> prompt;
    std::stringstream ids(argv[5]);
    for (std::string id; std::getline(ids, id, ',');) {
        prompt.push_back((llama_token) atoi(id.c_str()));
    }
    if (prompt.empty() || n_predict < 1 || threads < 1 || repeats < 1) {
        fprintf(stderr, "need a non-empty prompt and THREADS, N_PREDICT, REPEATS >= 1\n");
        return 2;
    }

    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = prompt.size() + n_predict + 8;
    cparams.n_batch = prompt.size();
    cparams.n_ubatch = prompt.size();
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.type_k = GGML_TYPE_F32;
    cparams.type_v = GGML_TYPE_F32;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "could not create a context for %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    Run first;
    std::vector<double> prefill_ms, decode_ms;
    for (int r = 0; r <= repeats; ++r) {
        Run run;
        if (!run_once(ctx, n_vocab, prompt, n_predict, run)) {
            return 1;
        }
        if (r == 0) {
            first = run;
            continue;
        }
        if (run.tokens != first.tokens) {
            fprintf(stderr, "repeat %d produced other tokens than the first run\n", r);
            return 1;
        }
        prefill_ms.push_back(run.prefill_ms);
        decode_ms.push_back(run.decode_ms_per_token);
    }

    printf("{");
    print_list("tokens", first.tokens, "%d", false);
    print_list("margins", first.margins, "%.6g", false);
    print_list("prefill_ms", prefill_ms, "%.4f", false);
    print_list("decode_ms_per_token", decode_ms, "%.5f", true);
    printf("}\n");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
