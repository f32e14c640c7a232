/** Request and response shapes. Enums are open: a value a newer server sends still type-checks. */
/** The text a chunk adds (empty for role-only and usage chunks). */
export function chunkText(chunk) {
    return chunk.choices
        .map((c) => ('delta' in c ? c.delta.content ?? '' : c.text ?? ''))
        .join('');
}
