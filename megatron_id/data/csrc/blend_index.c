/* The blend index of megatron_id/data/sample_index.py in C: sample i of a blend comes from the
 * dataset furthest behind its weight (largest w[d] * (i + 1) - count[d], the first such d on a
 * tie), Megatron's greedy rule. The arithmetic is Python's, in the same order and in double
 * precision (built with -ffp-contract=off: a fused multiply-add would round differently), so the
 * output is identical to build_blending_index_reference's, which the tests check.
 * Loaded with ctypes by megatron_id/data/native.py; no Python or numpy headers needed. */
#include <stdint.h>

/* weights[num_datasets]; out: dataset_index[num_samples] (int16), sample_index[num_samples]
 * (int32 when sample_width is 4, int64 when 8), counts[num_datasets] (int64, zeroed by the caller:
 * how many samples each dataset gives). Returns 0, or -1 for a sample_width it cannot write. */
int megatron_id_blend_index(const double *weights, int32_t num_datasets, int64_t num_samples,
                            int16_t *dataset_index, void *sample_index, int32_t sample_width,
                            int64_t *counts) {
    if (sample_width != 4 && sample_width != 8) return -1;
    int32_t *index32 = (int32_t *)sample_index;
    int64_t *index64 = (int64_t *)sample_index;
    for (int64_t i = 0; i < num_samples; i++) {
        const double steps = (double)(i + 1);
        int32_t best = 0;
        double best_error = weights[0] * steps - (double)counts[0];
        for (int32_t d = 1; d < num_datasets; d++) {
            const double error = weights[d] * steps - (double)counts[d];
            if (error > best_error) {
                best = d;
                best_error = error;
            }
        }
        dataset_index[i] = (int16_t)best;
        if (sample_width == 4) index32[i] = (int32_t)counts[best];
        else index64[i] = counts[best];
        counts[best] += 1;
    }
    return 0;
}
