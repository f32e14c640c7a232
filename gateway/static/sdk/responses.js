/** The Responses API (`/v1/responses`): request and response shapes, and `outputText`. */
/** The text of every message item, joined (as openai's `output_text`). */
export function outputText(response) {
    return response.output
        .filter((item) => item.type === 'message')
        .flatMap((item) => item.content ?? [])
        .filter((part) => part.type === 'output_text')
        .map((part) => part.text)
        .join('');
}
